#!/bin/sh
# Runs ops/cross_entropy/cross_entropy.cu on the CPU (no GPU needed): builds cross_entropy_emu.cpp with
# g++ (C++20) and runs it. Pass --quick for fewer launch shapes.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/graft-cuda-ce-emu-$$"
g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -rdynamic -I"$here" -I"$here/../src/ops" "$here/cross_entropy_emu.cpp" -o "$out" -ldl
status=0
"$out" "$@" || status=$?
rm -f "$out"
exit $status
