#!/bin/sh
# Runs ops/glu/glu.cu and ops/rope/rope.cu on the CPU (no GPU needed): builds glu_rope_test.cpp
# with g++ (C++20) and runs it.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/graft-cuda-emu-glu-rope-$$"
g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -rdynamic -I"$here" -I"$here/../src/ops" "$here/glu_rope_test.cpp" -o "$out" -ldl
status=0
"$out" "$@" || status=$?
rm -f "$out"
exit $status
