#!/usr/bin/env bash
# Prepares cuTile for the GPU machine (Python 3.12, no network, 64 MiB of git-ignored files a
# call): cuda-tile and the toolchain its tileiras runs, ~154 MiB of wheels, packed into four
# git-ignored folders .tileA to .tileD of ~42 MiB each (a call's 64 MiB also counts the
# tracked tree, ~10 MiB), with torchgraft's own abi3 wheel
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
# The wheels go into one tar, split in four equal pieces (one a call); the last call's
# bench/cutile_gpu_check.sh joins them, checks the sha256 in MANIFEST and installs.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
FOLDERS=(.tileA .tileB .tileC .tileD)
for folder in "${FOLDERS[@]}"; do
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
rm -rf .tileA .tileB .tileC .tileD; mkdir "${FOLDERS[@]}"
(cd "$dl" && split -n ${#FOLDERS[@]} -d cutile-wheels.tar piece.)
for i in "${!FOLDERS[@]}"; do mv "$dl/piece.0$i" "${FOLDERS[$i]}/"; done
{
    echo "# cuTile for the GPU machine: cat piece.0* > cutile-wheels.tar"
    echo "tar $(sha256sum "$dl/cutile-wheels.tar" | cut -d' ' -f1) cutile-wheels.tar"
    for folder in "${FOLDERS[@]}"; do
        piece=$(ls "$folder"/piece.0*)
        echo "piece $(sha256sum "$piece" | cut -d' ' -f1) $(basename "$piece")"
    done
    (cd "$dl/wheels" && for w in *.whl; do echo "wheel $(sha256sum "$w" | cut -d' ' -f1) $w $(stat -c %s "$w")"; done)
} > .tileD/MANIFEST
cat .tileD/MANIFEST
du -b --apparent-size -s "${FOLDERS[@]}" | awk '{printf "%-7s %6.1f MiB\n", $2, $1 / 1048576}'
for folder in "${FOLDERS[@]}"; do
    size=$(du -b --apparent-size -s "$folder" | cut -f1)
    [ "$size" -le $((48 * 1048576)) ] || { echo "$folder is over 48 MiB"; exit 1; }
done
cat <<'MSG'
On the GPU machine, four calls back to back (it keeps /tmp only ~30 s after a call):
 1) carry [".tileA"]:  mkdir -p /tmp/tile && cp .tileA/* /tmp/tile/
 2) carry [".tileB"]:  cp .tileB/* /tmp/tile/
 3) carry [".tileC"]:  cp .tileC/* /tmp/tile/
 4) carry [".tileD"]:  bash bench/cutile_gpu_check.sh
MSG
