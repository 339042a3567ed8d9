#!/bin/sh
# Runs ops/rms_norm/rms_norm.cu on the CPU (no GPU needed): builds emu_test.cpp with g++
# (C++20) and runs it. Pass --quick for fewer shapes.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/graft-cuda-emu-$$"
g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -rdynamic -I"$here" -I"$here/../src/ops" "$here/emu_test.cpp" -o "$out" -ldl
status=0
"$out" "$@" || status=$?
rm -f "$out"
exit $status
