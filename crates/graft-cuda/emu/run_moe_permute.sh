#!/bin/sh
# Runs ops/moe_permute/moe_permute.cu on the CPU (no GPU needed): builds moe_permute_test.cpp with
# g++ (C++20) and runs it.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/graft-cuda-emu-moe-permute-$$"
g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -rdynamic -I"$here" -I"$here/../src/ops" "$here/moe_permute_test.cpp" -o "$out" -ldl
status=0
"$out" "$@" || status=$?
rm -f "$out"
exit $status
