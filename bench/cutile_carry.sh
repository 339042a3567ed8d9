#!/usr/bin/env bash
# Prepares cuTile for the GPU machine (Python 3.12, no network, 64 MiB of git-ignored files a
# call): cuda-tile and the toolchain its tileiras runs, ~154 MiB of wheels, packed into three
# git-ignored folders .tileA, .tileB, .tileC of ~55 MiB each, with torchgraft's own abi3 wheel
# from dist/ (the native route, to time against; 'make wheel' builds it). In the project's root:
#   bash bench/cutile_carry.sh
#
# What cuTile needs (read from the wheels' metadata and cuda.tile 1.7.0's _compile.py):
#   cuda-tile 1.7.0           cuda.tile (needs typing-extensions, which torch already brings)
#   nvidia-cuda-tileiras      tileiras, the Tile IR compiler; its toolkit root is $CUDA_HOME, else
#                             the folder above its bin/; there it loads lib/libnvvm.so.4 (or
#                             nvvm/lib64/libnvvm.so) and runs bin/ptxas. Without libNVVM every
#                             compile fails with "failed to compile Tile IR program", no detail.
#   nvidia-nvvm               lib/libnvvm.so.4 (libNVVM, same release as tileiras)
#   nvidia-cuda-nvcc          bin/ptxas, bin/fatbinary (same release)
#   nvidia-cuda-crt           nvcc's headers (a dependency of nvidia-cuda-nvcc, 0.2 MB)
# cuda.tile uses the pip tileiras only when nvidia-cuda-tileiras, nvidia-cuda-nvcc and nvidia-nvvm
# share major.minor (else it warns and looks for a tileiras on PATH / in $CUDA_HOME/bin), and then
# runs it without CUDA_HOME. nvidia-nvjitlink (declared by the tileiras wheel, 42 MB) and
# nvidia-cuda-runtime (by nvcc) are left out: neither tileiras, tileirdisasm nor cuda.tile's
# extension names libnvJitLink or libcudart, and a 13.4 cudart beside torch's 13.0 one is a risk
# for nothing.
#
# The wheels go into one tar, split in three equal pieces (one a call); the last call's
# bench/cutile_gpu_check.sh joins them, checks the sha256 in MANIFEST and installs.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
for folder in .tileA .tileB .tileC; do
    grep -qx "/$folder/" "$exclude" 2>/dev/null || echo "/$folder/" >> "$exclude"
done
CUTILE=${CUTILE_VERSION:-1.7.0}
CUDA_TILE_TOOLS=${CUDA_TILE_TOOLS:-13.4.92}
dl=$(mktemp -d); trap 'rm -rf "$dl"' EXIT
mkdir "$dl/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform any -d "$dl/wheels" \
    "cuda-tile==$CUTILE" "nvidia-cuda-tileiras==$CUDA_TILE_TOOLS" "nvidia-cuda-nvcc==$CUDA_TILE_TOOLS" \
    "nvidia-nvvm==$CUDA_TILE_TOOLS" "nvidia-cuda-crt==$CUDA_TILE_TOOLS"
ls "$dl/wheels"/*.whl | wc -l | grep -qx 5 || { echo "expected 5 wheels"; ls -la "$dl/wheels"; exit 1; }
wheel=$(ls -t dist/torchgraft-*-abi3-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$wheel" ]; then
    cp -p "$wheel" "$dl/wheels/"
    echo "torchgraft wheel: $wheel (built $(stat -c %y "$wheel" | cut -d. -f1))"
else
    echo "no dist/torchgraft-*-abi3-*.whl ('make wheel' builds it): the native route will be off"
fi
(cd "$dl/wheels" && tar -cf ../cutile-wheels.tar ./*.whl)
rm -rf .tileA .tileB .tileC; mkdir .tileA .tileB .tileC
(cd "$dl" && split -n 3 -d cutile-wheels.tar piece.)
mv "$dl/piece.00" .tileA/; mv "$dl/piece.01" .tileB/; mv "$dl/piece.02" .tileC/
{
    echo "# cuTile for the GPU machine: cat piece.00 piece.01 piece.02 > cutile-wheels.tar"
    echo "tar $(sha256sum "$dl/cutile-wheels.tar" | cut -d' ' -f1) cutile-wheels.tar"
    for piece in .tileA/piece.00 .tileB/piece.01 .tileC/piece.02; do
        echo "piece $(sha256sum "$piece" | cut -d' ' -f1) $(basename "$piece")"
    done
    (cd "$dl/wheels" && for w in *.whl; do echo "wheel $(sha256sum "$w" | cut -d' ' -f1) $w $(stat -c %s "$w")"; done)
} > .tileC/MANIFEST
cat .tileC/MANIFEST
du -b --apparent-size -s .tileA .tileB .tileC | awk '{printf "%-7s %6.1f MiB\n", $2, $1 / 1048576}'
for folder in .tileA .tileB .tileC; do
    size=$(du -b --apparent-size -s "$folder" | cut -f1)
    [ "$size" -le $((60 * 1048576)) ] || { echo "$folder is over 60 MiB"; exit 1; }
done
cat <<'MSG'
On the GPU machine, three calls back to back (it keeps /tmp only ~30 s after a call):
 1) carry [".tileA"]:  mkdir -p /tmp/tile && cp .tileA/* /tmp/tile/
 2) carry [".tileB"]:  cp .tileB/* /tmp/tile/
 3) carry [".tileC"]:  bash bench/cutile_gpu_check.sh
MSG
