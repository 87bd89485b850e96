# Colibri — every target bootstraps what it needs (virtualenv, pinned packages, gRPC stubs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PB := colibri_common/pb
PROTOS := $(wildcard protos/*.proto)
PB_STAMP := $(PB)/.generated

.PHONY: setup native bytecode demo test test-gpu lint bench bench-kernels bench-cache bench-elastic bench-openai bench-gpu chart-check clean

setup: $(STAMP) $(PB_STAMP) native bytecode

# Our modules' bytecode, compiled ahead (what pip does for an installed package; quick when up to date): where
# PYTHONDONTWRITEBYTECODE is set, every `colibri` start would compile them again (0.1-0.2 s of start -> ready).
bytecode: $(PB_STAMP)
	$(PY) -m compileall -q colibri colibri_common router_service expert_service kernels benchmarks

# The native CPU kernels (kernels/native/, g++): rebuilt when their sources change; without a compiler, or if
# the build fails, it says so and the torch forms run.
native: $(STAMP)
	$(PY) -c 'import sys; from kernels import native_build; native_build.build(force="--force" in sys.argv)' 

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Stubs are generated under the virtual path colibri_common/pb so imports are package-absolute.
$(PB_STAMP): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -I$(PB)=protos --python_out=. --pyi_out=. --grpc_python_out=. \
		$(patsubst protos/%,$(PB)/%,$(PROTOS))
	touch $(PB_STAMP)

demo: setup
	$(PY) -m benchmarks.demo

# The layer contract (pyproject.toml, [tool.importlinter]) runs first: a wrong import fails the suite.
# Two pytest processes (pytest-xdist): most tests run one torch thread, so a second process uses the second
# core; the services they start are forked from a pre-imported fork server (tests/forkserver.py).
# Then the kernel, forms and oracle tests again under a second ATen kernel level and a second level of the native
# kernels (tests/other_isa.py: AVX2 on an AVX-512 machine, torch's portable kernels and the generic native build
# on an AVX2 one), so no test assumes the developer's ISA.
# The same-token tests (ALONE) run on their own after each parallel pass, ~20 s: their fleets compare logits to the
# bit on a quiet machine. Beside the rest of the suite a fleet now and then computes its decode steps otherwise, the
# same other bits whatever its shape (an open bug, docs/models.md), and a CI run once saw that last 4 tries running.
TEST_WORKERS ?= 2
ALONE := tests/test_same_tokens.py
ISA_TESTS := tests/kernels tests/test_e2e_oracle.py tests/test_quantize.py
test: setup
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --ignore=$(ALONE) tests
	$(PY) -m pytest -q $(ALONE)
	levels="$$($(PY) -m tests.other_isa)" && echo "$$levels:" && \
		env $$levels $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(ISA_TESTS) && \
		env $$levels $(PY) -m pytest -q $(ALONE)

# The GPU tests (tests/gpu: the Triton kernels against float64 on the GPU, the engine and `serve --gpus 0` against
# transformers); `make test` skips them where no CUDA GPU is visible. benchmarks/gpu_check.sh runs them with
# bench-gpu on a machine that cannot build this virtualenv.
test-gpu: setup
	COLIBRI_REQUIRE_GPU=1 $(PY) -m pytest -q -n 4 tests/gpu

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

bench: setup
	$(PY) -m benchmarks.serving

# The fused MoE against its peers (benchmarks/results/kernels.md), then the native kernels' GB/s and % of the read
# rate at T = 1, 8, 32 on 1 and 2 threads, bf16 and int8 (benchmarks/results/native_kernels.md).
bench-kernels: setup
	$(PY) -m benchmarks.kernels
	OMP_WAIT_POLICY=PASSIVE $(PY) -m benchmarks.native_kernels

# The expert tiers on a skewed checkpoint (built once in .cache/): writes benchmarks/results/expert_cache.md.
bench-cache: setup
	$(PY) -m benchmarks.expert_cache

# Placement from load and live resizes on a skewed checkpoint (built once in .cache/): writes
# benchmarks/results/elastic.md.
bench-elastic: setup
	$(PY) -m benchmarks.elastic

# The OpenAI HTTP front against the gRPC API at 1 and 32 streams: writes benchmarks/results/openai_front.md.
bench-openai: setup
	$(PY) -m benchmarks.openai_front

# Needs a CUDA GPU (and a CUDA build of torch 2.13.0 with triton 3.7.1); writes benchmarks/results/gpu.md.
# benchmarks/gpu_check.sh runs it with the GPU tests where this virtualenv cannot be built.
bench-gpu: setup
	$(PY) -m benchmarks.gpu

chart-check: setup
	$(PY) -m pytest -q tests/test_chart.py

clean:
	rm -rf $(VENV) $(PB)/*_pb2*.py $(PB)/*.pyi $(PB_STAMP)
