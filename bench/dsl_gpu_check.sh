#!/usr/bin/env bash
# The DSL routes on the GPU machine in one call: install the carried wheels, run the CUDA
# tests of FA4 / quack / Helion, then the benchmarks, and leave everything under $OUT.
#
# Prepared here (repo root):   bash ../shared/tools/cutedsl-carry.sh   (.cuteA, .cuteB)
#                              bash bench/dsl_gpu_wheels.sh           (.dslwhl: torchgraft + helion)
# Then two device calls back to back (the machine keeps /tmp only while warm, ~30 s):
#   1) carry [".cuteA"]:                 mkdir -p /tmp/cute && cp .cuteA/* /tmp/cute/
#   2) carry [".cuteB", ".dslwhl"]:      bash bench/dsl_gpu_check.sh
#
# $OUT gets (8 files at most come back): check.log (everything printed), doctor.json,
# tests.xml (junit), attention_fa4.json, attention_crossover.json (copy to
# python/torchgraft/ops/attention/crossover.json), rms_norm/<stem>.json and .md (quack vs
# native vs Triton vs Helion vs ATen), helion_configs.json (only if time was left; copy to
# python/torchgraft/ops/rms_norm/helion_configs.json). Each stage has a time limit so the whole
# run ends before the 600 s a call may take; a stage that runs out leaves what it wrote.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
DEADLINE=${DSL_CHECK_SECONDS:-560}
OUT=${OUT:-/tmp/dsl-out}
mkdir -p "$OUT/rms_norm"
exec > >(tee -a "$OUT/check.log") 2>&1
left() { echo $((DEADLINE - (SECONDS - START))); }
stage() { echo; echo "== $* (t=$((SECONDS - START)) s, $(left) s left)"; }

stage "install"
if [ -n "$(ls /tmp/cute/part.aa 2>/dev/null)" ] && [ -f .cuteB/WHEEL_NAME ]; then
    cat /tmp/cute/part.aa .cuteB/part.ab > "/tmp/cute/$(cat .cuteB/WHEEL_NAME)" && rm /tmp/cute/part.aa
fi
ls /tmp/cute/*.whl .dslwhl/*.whl 2>/dev/null | sed 's/^/  /'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site /tmp/cute/*.whl .dslwhl/*.whl || { echo "install failed"; exit 1; }
# --target skips the cutlass package's .pth file; the tree's python/ comes first (the tests
# and benchmarks of this checkout), with the wheel's compiled extension copied into it.
cp /tmp/site/torchgraft/_native*.so python/torchgraft/ 2>/dev/null || echo "  (no torchgraft wheel carried: native route off)"
export PYTHONPATH="$PWD/python:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
export PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

stage "doctor"
python3 -m torchgraft doctor --json > "$OUT/doctor.json"
python3 -m torchgraft doctor | sed -n '/DSL runtimes/,/other packages/p'
python3 -c "import flash_attn.cute.interface, quack.rmsnorm, helion; print('imports: FA4, quack, helion ok')"

stage "CUDA tests of the DSL routes"
timeout $(( $(left) > 300 ? 240 : $(left) / 2 )) python3 -m pytest -q -rs -p no:cacheprovider \
    --junitxml="$OUT/tests.xml" tests/test_attention_fa4_cuda.py tests/test_rms_norm_dsl_cuda.py
echo "pytest exit status $?"

stage "FA4 vs cuDNN vs flash"
budget=$(( $(left) - 150 ))
if [ "$budget" -gt 30 ]; then
    timeout $((budget + 60)) python3 bench/attention_fa4.py --budget "$budget" \
        --out "$OUT/attention_fa4.json" --write-crossover "$OUT/attention_crossover.json"
else
    echo "skipped: no time left"
fi

stage "RMSNorm: quack vs native vs Triton vs Helion vs ATen"
if [ "$(left)" -gt 45 ]; then
    timeout $(( $(left) - 15 )) python3 -m torchgraft bench rms_norm --device cuda --dtype bf16 \
        --routes aten,compile,torchgraft-native,torchgraft-triton,torchgraft-cutedsl,torchgraft-helion \
        --shapes 8x4096x4096,32768x4096,4096x8192,16384x2048 --quick --no-plot --out "$OUT/rms_norm"
else
    echo "skipped: no time left"
fi

stage "Helion tuning (one problem per kernel, if time is left)"
if [ "$(left)" -gt 100 ]; then
    timeout $(( $(left) - 10 )) python3 bench/helion_tune.py --hidden 4096 --dtypes bf16 \
        --budget $(( $(left) - 100 )) --out "$OUT/helion_configs.json"
else
    echo "skipped: no time left (run bench/helion_tune.py in a call of its own)"
fi
stage "done"
