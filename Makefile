# torchgraft: a fresh machine needs two commands, `make demo` and `make test`.
# Each creates the virtual environment, installs torch and the build tools from
# the package registry, builds the Rust extension (release) and runs its job.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH ?= 2.15.0
PY := $(VENV)/bin/python
# nvcc 13.0 from PyPI, pinned as one family so its pieces agree (the GPU machines run 13.0).
CUDA_TOOLS := nvidia-cuda-nvcc==13.0.* nvidia-nvvm==13.0.* nvidia-cuda-crt==13.0.* nvidia-cuda-cccl==13.0.*
# transformers (5.17, as on the GPU machines) and kernels (0.16.x, the range transformers 5.17 accepts):
# model adoption and the end-to-end benchmark are tested on tiny models built from configs; peft
# (0.21.x, for transformers 5.x): the adoption mutation tests put LoRA on adopted models.
PY_TOOLS := numpy pytest pytest-xdist ruff matplotlib "maturin>=1.7,<2" hypothesis transformers==5.17.0 "kernels>=0.16,<0.17" "peft>=0.21,<0.22"
# Helion (the Helion RMSNorm's CPU tests run its generated Triton in Triton's interpreter):
# 1.5.x needs torch >= 2.13 (torchgraft/dsl/helion.py), 1.4.0 runs on 2.11 and 2.12.
HELION := $(if $(filter 2.11.% 2.12.%,$(TORCH)),helion==1.4.0,helion==1.5.1)
# The stamp names the package list, so changing it reinstalls.
DEPS_STAMP := $(VENV)/.torchgraft-deps-$(shell echo '$(TORCH) $(PY_TOOLS) $(HELION) $(CUDA_TOOLS)' | md5sum | cut -c1-12)
# A venv that only runs the Python tests against the wheel needs no compiler.
TEST_DEPS_STAMP := $(VENV)/.torchgraft-test-deps-$(shell echo '$(TORCH) $(PY_TOOLS) $(HELION)' | md5sum | cut -c1-12)
# pytest workers (pytest-xdist): the suite is CPU-bound, one worker per core pays on two cores.
PYTEST_WORKERS ?= 2
# The newest wheel `make wheel` wrote (abi3: one wheel for every torch and Python).
WHEEL = $(shell ls -t dist/torchgraft-*.whl 2>/dev/null | head -n 1)
# graft-cuda's build script compiles the CUDA kernels with $NVCC when it is set.
WITH_NVCC = NVCC="$$(ls $(abspath $(VENV))/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -n 1)"

.PHONY: demo test deps build test-rust test-host test-python test-deps test-wheel test-compat lint fmt bench wheel clean

demo: build
	$(PY) -m torchgraft demo

test: test-rust test-host test-python

$(DEPS_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH) $(PY_TOOLS) $(HELION) $(CUDA_TOOLS)
	touch $@

deps: $(DEPS_STAMP)

build: deps
	$(WITH_NVCC) VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release -q

test-rust: deps
	$(WITH_NVCC) cargo test --workspace --release -q

# The native grafts from a program with no Python: libtorch from the venv's torch wheel.
test-host: deps
	$(WITH_NVCC) cargo build --release -q -p graft-capi -p graft-host
	target/release/torchgraft-host --device cpu \
		--torch-lib "$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))')/lib" \
		--graft-lib target/release/libtorchgraft.so

test-python: build
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests

$(TEST_DEPS_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH) $(PY_TOOLS) $(HELION)
	touch $@

# The compatibility set (tests marked `compat`: the wheel loads, the registry, every op forward
# and backward, adoption, compile) against the wheel in dist/ on another torch, in one venv that
# moves from version to version (pip then downloads only what changed):
#   make test-compat TORCH=2.11.0
test-compat:
	$(MAKE) test-wheel VENV=.venv-compat TORCH=$(TORCH) PYTEST_ARGS="-m compat"

# The Python tests against the wheel in dist/ (built once by `make wheel`) on another torch:
#   make test-wheel VENV=.venv-torch211 TORCH=2.11.0
# The tests then import the installed wheel, not python/ (checked before they run).
test-deps: $(TEST_DEPS_STAMP)

test-wheel: $(TEST_DEPS_STAMP)
	@test -n "$(WHEEL)" || { echo "no wheel in dist/: run 'make wheel' first"; exit 1; }
	$(PY) -m pip install -q --no-deps --force-reinstall $(WHEEL)
	$(PY) -c 'import torch, torchgraft, torchgraft.native as n; \
		assert "site-packages" in torchgraft.__file__, torchgraft.__file__; \
		print("torch", torch.__version__, "| torchgraft from", torchgraft.__file__, "| native:", n.available())'
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS) tests

# clippy without nvcc: the kernels only add an include_bytes! of the fatbin (cfg graft_cuda_kernels),
# and clippy's build differs from cargo's, so with NVCC it would compile the fatbin again (7
# minutes on two cores).
lint: deps
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --release -q -- -D warnings
	$(VENV)/bin/ruff check python tests bench
	$(VENV)/bin/ruff format --check python tests bench

fmt: deps
	cargo fmt --all
	$(VENV)/bin/ruff format python tests bench
	$(VENV)/bin/ruff check --fix python tests bench

bench: build
	$(PY) bench/rms_norm_cpu.py

# An abi3 wheel (one for every Python >= 3.10 and torch >= 2.11), for the GPU machine.
wheel: deps
	$(WITH_NVCC) $(VENV)/bin/maturin build --release -q -o dist

clean:
	cargo clean
	rm -rf $(VENV) .venv-torch* .venv-compat dist python/torchgraft/*.so
