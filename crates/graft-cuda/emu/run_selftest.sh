#!/bin/sh
# Runs examples/selftest/ on the CPU: builds mock_libcuda.cpp (a libcuda.so.1 that runs
# the kernels through cuda_emu.h) and runs the selftest binary against it.
# Usage: emu/run_selftest.sh [path/to/selftest] [selftest args; default --small]
# Build the binary first: NVCC=... cargo build --release -p graft-cuda --example selftest
set -e
here="$(cd "$(dirname "$0")" && pwd)"
bin="${1:-$here/../../../target/release/examples/selftest}"
[ $# -gt 0 ] && shift
[ $# -eq 0 ] && set -- --small
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
g++ -std=c++20 -O2 -shared -fPIC -I"$here" -I"$here/../src/ops" "$here/mock_libcuda.cpp" -o "$tmp/libcuda.so.1" -ldl
LD_LIBRARY_PATH="$tmp" "$bin" "$@"
