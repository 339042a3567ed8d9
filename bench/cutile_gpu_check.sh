#!/usr/bin/env bash
# cuTile on the GPU machine: join and install the carried wheels, say everything that decides
# whether cuTile compiles and runs here (driver, toolchain, which tileiras cuda.tile picks, a
# vector add compiled ahead of time and launched, tileiras by hand on its bytecode), then the
# cuTile RMSNorm's CUDA tests and a timing against ATen and the native route. Everything goes
# to $OUT/cutile.log.
#
# Prepared here (repo root):  bash bench/cutile_carry.sh   (.tileA to .tileD; ~42 MiB each)
# Then four device calls back to back (the machine keeps /tmp only ~30 s after a call):
#   1) carry [".tileA"]:  mkdir -p /tmp/tile && cp .tileA/* /tmp/tile/
#   2) carry [".tileB"]:  cp .tileB/* /tmp/tile/
#   3) carry [".tileC"]:  cp .tileC/* /tmp/tile/
#   4) carry [".tileD"]:  bash bench/cutile_gpu_check.sh
# A warm machine keeps /tmp/site: a later call with carry [".tileD"] installs nothing, and
# CUTILE_CHECK_STAGES=tests,bench (of diag,tests,bench) picks stages.
#
# $OUT gets (8 files at most come back): cutile.log, doctor.json, tests.xml (junit),
# rms_norm/<stem>.json and .md (the timing). Every command is time-limited; the call ends
# within CUTILE_CHECK_SECONDS (540).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
DEADLINE=${CUTILE_CHECK_SECONDS:-540}
STAGES=",${CUTILE_CHECK_STAGES:-diag,tests,bench},"
OUT=${OUT:-/tmp/cutile-out}
SITE=/tmp/site
TOOLKIT=$SITE/nvidia/cu13
mkdir -p "$OUT/rms_norm"
exec > >(tee -a "$OUT/cutile.log") 2>&1
left() { echo $((DEADLINE - (SECONDS - START))); }
stage() { echo; echo "== $* (t=$((SECONDS - START)) s, $(left) s left)"; }
wanted() { [[ "$STAGES" == *",$1,"* ]]; }
# run SECONDS CMD...: the command, killed after SECONDS (and never past the deadline).
run() {
    local limit=$1; shift
    local most=$(( $(left) - 5 ))
    [ "$limit" -gt "$most" ] && limit=$most
    if [ "$limit" -le 0 ]; then echo "  (skipped, no time left: $*)"; return 124; fi
    echo "\$ $*"
    timeout "$limit" "$@"
    local status=$?
    [ "$status" -eq 124 ] && echo "  (timed out after $limit s)"
    [ "$status" -ne 0 ] && echo "  (exit status $status)"
    return $status
}

stage "install"
if [ -f $SITE/.cutile-installed ]; then
    echo "  $SITE already installed (warm machine)"
else
    cp .tileD/piece.0* /tmp/tile/ 2>/dev/null || { echo "no .tileD carried"; exit 1; }
    ls -la /tmp/tile
    pieces=$(awk '$1 == "piece" {print $3}' .tileD/MANIFEST)
    (cd /tmp/tile && cat $pieces > cutile-wheels.tar) ||
        { echo "missing pieces: run calls 1 to 3 right before this one"; exit 1; }
    want=$(awk '$1 == "tar" {print $2}' .tileD/MANIFEST)
    got=$(sha256sum /tmp/tile/cutile-wheels.tar | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "sha256 mismatch: $got, MANIFEST says $want"; exit 1; }
    rm -f /tmp/tile/piece.0*
    mkdir -p /tmp/tile/wheels && tar -xf /tmp/tile/cutile-wheels.tar -C /tmp/tile/wheels &&
        rm /tmp/tile/cutile-wheels.tar
    ls -la /tmp/tile/wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target $SITE /tmp/tile/wheels/*.whl || { echo "install failed"; exit 1; }
    touch $SITE/.cutile-installed
fi
# The tree's python/ first (this checkout's kernels and tests), with the wheel's compiled
# extension copied into it (the native route).
cp $SITE/torchgraft/_native*.so python/torchgraft/ 2>/dev/null ||
    echo "  (no torchgraft wheel carried: the native route is off)"
export PYTHONPATH="$PWD/python:$SITE"
export PYTHONUNBUFFERED=1
# cuda.tile runs the pip tileiras without CUDA_HOME; a tileiras found on PATH instead (the
# fallback) gets CUDA_HOME passed and would take libNVVM and ptxas from the machine's CUDA 13.0
# toolkit. Unset, tileiras takes them from the folder above its bin/ ($TOOLKIT): the 13.4 ones.
unset CUDA_HOME CUDA_PATH CUDA_ROOT
export PATH="$PATH:$TOOLKIT/bin"
export CUDA_TILE_TEMP_DIR=/tmp/cutile-tmp CUDA_TILE_CACHE_DIR=/tmp/cutile-cache
export CUDA_TILE_ENABLE_CRASH_DUMP=0

if wanted diag; then
    stage "driver and GPU"
    run 20 nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader
    run 20 nvidia-smi | head -5
    stage "toolchain ($TOOLKIT)"
    ls -la "$TOOLKIT/bin" "$TOOLKIT/lib" "$TOOLKIT/nvvm" 2>&1 | sed 's/^/  /'
    run 20 "$TOOLKIT/bin/tileiras" --version
    run 20 "$TOOLKIT/bin/tileiras" --list-versions
    run 20 "$TOOLKIT/bin/ptxas" --version
    echo "system toolkit (not used by the pip tileiras):"
    run 20 bash -c 'command -v ptxas nvcc tileiras; ls -d /usr/local/cuda* 2>/dev/null; ptxas --version 2>/dev/null | tail -1'
    stage "what cuda.tile sees"
    run 60 python3 - <<'EOF'
import importlib.metadata as md
import os, sys
import torch
for pkg in ("cuda-tile", "nvidia-cuda-tileiras", "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt",
            "nvidia-nvjitlink", "nvidia-cuda-runtime"):
    try:
        dist = md.distribution(pkg)
        print(f"  {pkg:22s} {dist.version:10s} {dist.locate_file('')}")
    except md.PackageNotFoundError:
        print(f"  {pkg:22s} not installed")
import nvidia.cu13
print("  nvidia.cu13.__path__:", list(nvidia.cu13.__path__))
import cuda.tile as ct
from cuda.tile import _cext, _compile
print("  cuda.tile", ct.__version__, "from", os.path.dirname(ct.__file__))
print("  torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
print("  driver version (cuda.tile):", _cext.get_driver_version())
print("  compute capability (cuda.tile):", _cext.get_compute_capability())
print("  pip tileiras (cuda.tile's first choice):", _compile._find_pip_tileiras())
binary = _compile._find_compiler_bin()
print("  tileiras cuda.tile runs:", binary.path, "| passes CUDA_HOME:", binary.pass_cuda_home_var)
print("  its version:", (_compile._get_compiler_version_string() or "?").strip().splitlines()[-2:])
temp = os.environ.get("CUDA_TILE_TEMP_DIR", "/tmp")
os.makedirs(temp, exist_ok=True)
# cuda.tile probes tileiras with an empty module per version (for sm_120); on the H100 with
# only the tileiras wheel every probe failed.
print("  newest bytecode version tileiras takes:", _compile._get_max_supported_bytecode_version(temp))
EOF
    stage "torchgraft doctor"
    run 60 python3 -m torchgraft doctor --json > "$OUT/doctor.json"
    run 60 python3 -m torchgraft doctor | sed -n '/DSL runtimes/,/other packages/p'

    stage "ahead-of-time compile for this GPU (no launch): vector add + RMSNorm kernels"
    arch=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}')")
    run 150 python3 bench/cutile_compile.py --arch "$arch" --hidden 4096 --dtypes bf16,fp32 \
        --bytecode-dir /tmp/cutile-bc
    stage "tileiras by hand on the vector add's bytecode (full stderr, files it opens/runs)"
    bc=$(ls /tmp/cutile-bc/vector_add*.tilebc 2>/dev/null | head -n 1)
    if [ -n "$bc" ]; then
        run 60 "$TOOLKIT/bin/tileiras" --gpu-name "$arch" -O3 --lineinfo --print-options \
            --remark-format=command-line --remarks=all "$bc" -o /tmp/cutile-bc/vadd.cubin
        if command -v strace > /dev/null; then
            run 60 strace -f -e trace=openat,execve -o /tmp/cutile-bc/strace.txt \
                "$TOOLKIT/bin/tileiras" --gpu-name "$arch" "$bc" -o /tmp/cutile-bc/vadd2.cubin
            grep -E 'execve|nvvm|ptxas|fatbin|cuda' /tmp/cutile-bc/strace.txt | grep -v ENOENT | head -20
            grep -E 'nvvm|ptxas' /tmp/cutile-bc/strace.txt | grep ENOENT | head -10
        else
            echo "  (no strace here)"
        fi
        echo "the same with the machine's CUDA 13.0 toolkit as CUDA_HOME (how it failed before):"
        run 60 env CUDA_HOME=/usr/local/cuda "$TOOLKIT/bin/tileiras" --gpu-name "$arch" "$bc" \
            -o /tmp/cutile-bc/vadd3.cubin
    else
        echo "  no bytecode was written (the compile above failed before tileiras)"
    fi

    stage "vector add through ct.launch, against torch"
    # From a file: cuda.tile reads the kernel's source (inspect), which stdin does not keep.
    cat > /tmp/cutile_vector_add.py <<'EOF'
import time
import torch
import cuda.tile as ct

@ct.kernel
def vector_add(a, b, c, tile: ct.Constant[int]):
    block = ct.bid(0)
    ct.store(c, (block,), ct.load(a, (block,), (tile,)) + ct.load(b, (block,), (tile,)))

n, tile = 1_000_003, 1024
a = torch.randn(n, device="cuda")
b = torch.randn(n, device="cuda")
c = torch.full_like(a, float("nan"))
start = time.perf_counter()
ct.launch(torch.cuda.current_stream(), (-(-n // tile),), vector_add, (a, b, c, tile))
torch.cuda.synchronize()
print(f"  first launch (compile + run) {time.perf_counter() - start:.2f} s")
print("  max |c - (a + b)| =", (c - (a + b)).abs().max().item(), "(0 expected)")
EOF
    run 120 python3 /tmp/cutile_vector_add.py
fi

if wanted tests; then
    stage "cuTile RMSNorm: CUDA tests against the float64 reference"
    run 240 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/tests.xml" \
        tests/grafts/rms_norm/test_cutile_rms_norm_cuda.py
fi

if wanted bench; then
    stage "cuTile RMSNorm vs ATen vs native (bf16)"
    run $(( $(left) - 10 )) python3 -m torchgraft bench rms_norm --device cuda --dtype bf16 \
        --routes aten,torchgraft-native,torchgraft-cutile \
        --shapes 8x4096x4096,32768x4096,4096x8192,16384x2048 --quick --no-plot --out "$OUT/rms_norm"
fi
stage "done"
ls -la "$OUT" "$OUT/rms_norm"
