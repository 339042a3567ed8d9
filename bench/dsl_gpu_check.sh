#!/usr/bin/env bash
# The DSL routes on the GPU machine: install the carried wheels, run the CUDA tests of FA4 /
# quack / Helion, then the benchmarks, and leave everything under $OUT.
#
# Prepared here (repo root):   bash ../shared/tools/cutedsl-carry.sh   (.cuteA, .cuteB)
#                              bash bench/dsl_gpu_wheels.sh           (.dslwhl: torchgraft + helion)
# Then device calls back to back (the machine keeps /tmp only while warm, ~30 s):
#   1) carry [".cuteA"]:                 mkdir -p /tmp/cute && cp .cuteA/* /tmp/cute/
#   2) carry [".cuteB", ".dslwhl"]:      bash bench/dsl_gpu_check.sh
# The second call runs every stage (tests, attention, rms_norm, helion) within ~9.5 minutes,
# each stage limited so the call ends in time. To give the FA4 sweep a call of its own, run
#   2) ... DSL_CHECK_STAGES=tests,rms_norm bash bench/dsl_gpu_check.sh
#   3) carry [".cuteB", ".dslwhl"]:  DSL_CHECK_STAGES=attention,helion bash bench/dsl_gpu_check.sh
# (a warm machine keeps /tmp/site and FA4's compiled kernels, so call 3 installs nothing).
# DSL_CHECK_QUICK= (set, empty) times the RMSNorm routes in full instead of --quick.
# With cuTile too (the one-run table of every DSL): first the three calls of
# bench/cutile_gpu_check.sh (it installs cuTile's toolchain into /tmp/site), then calls 1 and 2
# with DSL_CHECK_STAGES=rms_norm: the RMSNorm stage adds the cuTile route when it finds that
# toolchain installed.
#
# $OUT gets (8 files at most come back): check.log (everything printed), doctor.json,
# tests.xml (junit), attention_fa4.json, attention_crossover.json (copy to
# python/torchgraft/grafts/attention/crossover.json), rms_norm/<stem>.json and .md (quack vs
# native vs Triton vs Helion vs ATen), helion_configs.json (copy to
# python/torchgraft/grafts/rms_norm/helion_configs.json). A stage that runs out of time leaves
# what it wrote (the FA4 sweep writes after every problem).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
DEADLINE=${DSL_CHECK_SECONDS:-560}
STAGES=",${DSL_CHECK_STAGES:-tests,attention,rms_norm,helion},"
OUT=${OUT:-/tmp/dsl-out}
mkdir -p "$OUT/rms_norm"
exec > >(tee -a "$OUT/check.log") 2>&1
left() { echo $((DEADLINE - (SECONDS - START))); }
stage() { echo; echo "== $* (t=$((SECONDS - START)) s, $(left) s left)"; }
wanted() { [[ "$STAGES" == *",$1,"* ]]; }

stage "install"
if [ -f /tmp/site/.dsl-installed ]; then
    echo "  /tmp/site already installed (warm machine)"
else
    if [ -f /tmp/cute/part.aa ] && [ -f .cuteB/WHEEL_NAME ]; then
        cat /tmp/cute/part.aa .cuteB/part.ab > "/tmp/cute/$(cat .cuteB/WHEEL_NAME)" && rm /tmp/cute/part.aa
    fi
    ls /tmp/cute/*.whl .dslwhl/*.whl 2>/dev/null | sed 's/^/  /'
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site /tmp/cute/*.whl .dslwhl/*.whl || { echo "install failed"; exit 1; }
    touch /tmp/site/.dsl-installed
fi
# --target skips the cutlass package's .pth file; the tree's python/ comes first (this
# checkout's tests and benchmarks), with the wheel's compiled extension copied into it.
cp /tmp/site/torchgraft/_native*.so python/torchgraft/ 2>/dev/null ||
    echo "  (no torchgraft wheel carried: the native route is off)"
export PYTHONPATH="$PWD/python:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
export PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
RMS_ROUTES=aten,compile,torchgraft-native,torchgraft-triton,torchgraft-cutedsl,torchgraft-helion
if [ -f /tmp/site/.cutile-installed ]; then
    # As bench/cutile_gpu_check.sh: the pip tileiras takes libNVVM and ptxas 13.4 from the folder
    # above its bin/ only without CUDA_HOME (the machine's 13.0 ones fail).
    unset CUDA_HOME CUDA_PATH CUDA_ROOT
    export PATH="$PATH:/tmp/site/nvidia/cu13/bin"
    export CUDA_TILE_TEMP_DIR=/tmp/cutile-tmp CUDA_TILE_CACHE_DIR=/tmp/cutile-cache
    export CUDA_TILE_ENABLE_CRASH_DUMP=0
    # One table of every DSL: torch.compile is not a DSL route, and its compiles take the time.
    RMS_ROUTES=aten,torchgraft-native,torchgraft-triton,torchgraft-cutedsl,torchgraft-helion,torchgraft-cutile
    echo "  cuTile toolchain installed: the RMSNorm stage runs the cuTile route too"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

stage "doctor"
python3 -m torchgraft doctor --json > "$OUT/doctor.json"
python3 -m torchgraft doctor | sed -n '/DSL runtimes/,/other packages/p'
python3 -c "import flash_attn.cute.interface, quack.rmsnorm, helion; print('imports: FA4, quack, helion ok')"

if wanted tests; then
    stage "CUDA tests of the DSL routes"
    timeout $(( $(left) > 420 ? 280 : $(left) / 2 )) python3 -m pytest -q -rs -p no:cacheprovider \
        --junitxml="$OUT/tests.xml" tests/grafts/attention/test_attention_fa4_cuda.py \
        tests/grafts/rms_norm/test_rms_norm_dsl_cuda.py
    echo "pytest exit status $?"
fi

if wanted attention; then
    stage "FA4 vs cuDNN vs flash"
    reserve=$(wanted rms_norm && echo 120 || echo 20)
    reserve=$((reserve + $(wanted helion && echo 90 || echo 0)))
    budget=$(( $(left) - reserve ))
    if [ "$budget" -gt 20 ]; then
        timeout $((budget + 60)) python3 bench/attention_fa4.py --budget "$budget" \
            --out "$OUT/attention_fa4.json" --write-crossover "$OUT/attention_crossover.json"
    else
        echo "skipped: no time left"
    fi
fi

if wanted rms_norm; then
    stage "RMSNorm: $RMS_ROUTES"
    if [ "$(left)" -gt 45 ]; then
        timeout $(( $(left) - 15 )) python3 -m torchgraft bench rms_norm --device cuda --dtype bf16 \
            --routes "$RMS_ROUTES" --shapes 8x4096x4096,32768x4096,4096x8192,16384x2048 \
            ${DSL_CHECK_QUICK---quick} --no-plot --out "$OUT/rms_norm"
    else
        echo "skipped: no time left"
    fi
fi

if wanted helion; then
    stage "Helion tuning"
    if [ "$(left)" -gt 100 ]; then
        timeout $(( $(left) - 10 )) python3 bench/helion_tune.py --hidden 4096,8192 --dtypes bf16 \
            --budget $(( $(left) - 100 )) --out "$OUT/helion_configs.json"
    else
        echo "skipped: no time left (run bench/helion_tune.py in a call of its own)"
    fi
fi
stage "done"
