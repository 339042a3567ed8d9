#!/bin/sh
# Runs ops/topk_sigmoid/topk_sigmoid.cu on the CPU (no GPU needed): builds topk_sigmoid_test.cpp
# with g++ (C++20) and runs it.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/graft-cuda-emu-topk-sigmoid-$$"
g++ -std=c++20 -O2 -fno-strict-aliasing -ffp-contract=off -pthread -rdynamic -I"$here" -I"$here/../src/ops" "$here/topk_sigmoid_test.cpp" -o "$out" -ldl
status=0
"$out" "$@" || status=$?
rm -f "$out"
exit $status
