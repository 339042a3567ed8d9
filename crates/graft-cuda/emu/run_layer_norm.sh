#!/bin/sh
# Runs ops/layer_norm/layer_norm.cu on the CPU (no GPU needed): builds layer_norm_test.cpp with g++ (C++20)
# and runs it.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/graft-cuda-emu-layer_norm-$$"
g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -rdynamic -I"$here" -I"$here/../src/ops" "$here/layer_norm_test.cpp" -o "$out" -ldl
status=0
"$out" "$@" || status=$?
rm -f "$out"
exit $status
