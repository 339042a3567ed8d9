#!/bin/sh
# Runs ops/softmax/softmax.cu on the CPU (no GPU needed): builds softmax_test.cpp with g++ (C++20)
# and runs it.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/graft-cuda-emu-softmax-$$"
g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -rdynamic -I"$here" -I"$here/../src/ops" "$here/softmax_test.cpp" -o "$out" -ldl
status=0
"$out" "$@" || status=$?
rm -f "$out"
exit $status
