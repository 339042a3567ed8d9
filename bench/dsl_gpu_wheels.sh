#!/usr/bin/env bash
# Gathers the wheels bench/dsl_gpu_check.sh installs on the GPU machine (Python 3.12, torch
# 2.11, no network) beside the CuteDSL ones of ../shared/tools/cutedsl-carry.sh: torchgraft's
# own abi3 wheel (built here: the native route) and Helion 1.4.0 (1.5.x does not import with
# torch 2.11) with rich and its dependencies (helion imports rich at import time). Run it in
# the project's root; it writes the git-ignored folder .dslwhl and prints its size.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
grep -qx '/.dslwhl/' "$exclude" 2>/dev/null || echo '/.dslwhl/' >> "$exclude"
rm -rf .dslwhl; mkdir .dslwhl
make -s wheel
cp "$(ls -t dist/torchgraft-*-abi3-*.whl | head -n 1)" .dslwhl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .dslwhl helion==1.4.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  pygments==2.21.0
ls -la .dslwhl; du -sh .dslwhl
