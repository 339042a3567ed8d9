#!/bin/sh
# Runs ops/adam/adam.cu on the CPU (no GPU needed): builds adam_test.cpp with g++ (C++20, no
# floating-point contraction, so that each step rounds as written) and runs it.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/graft-cuda-emu-adam-$$"
g++ -std=c++20 -O1 -fno-strict-aliasing -ffp-contract=off -pthread -I"$here" -I"$here/../src/ops" "$here/adam_test.cpp" -o "$out"
status=0
"$out" "$@" || status=$?
rm -f "$out"
exit $status
