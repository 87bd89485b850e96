#!/usr/bin/env bash
# A GPU session's checks in one run, for a machine that is lent a CUDA GPU for minutes and cannot build the pinned
# virtualenv (no registry): the machine's own python3, torch and triton, and the pinned packages it lacks as wheels
# in .whl/ (made where pip works, with `pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux2014_x86_64 -d .whl NAME==VERSION` for grpcio, grpcio-health-checking,
# grpcio-reflection, protobuf, tokenizers, transformers, huggingface_hub, hf-xet, httpx2, httpcore2, truststore,
# starlette, uvicorn, httptools, setproctitle, prometheus_client, safetensors, click, anyio, idna, h11 and regex at
# requirements.txt's versions). Runs, each step bounded and logged:
#   1. the GPU's facts and the packages' versions          -> $OUT/env.txt
#   2. the Triton kernels compiled for sm_80 / sm_90 to IR  -> $OUT/gpu_compile.log
#   3. the GPU tests (tests/gpu: kernels against float64, serving against transformers)  -> $OUT/gpu-tests.log
#   4. make bench-gpu's script (fused MoE against the HBM roofline, serving tok/s)  -> $OUT/gpu.md, bench-gpu.log
#   5. (asked for only) benchmarks.gpu_profile: where the fused MoE's and a decode step's time goes  -> $OUT/profile.txt
# STEPS="compile tests bench" by default (the env step always runs); PYTEST_ARGS narrows the tests (e.g. "-k bfloat16"),
# PROFILE_ARGS the profile (e.g. "--tokens 1 --streams 1"), PROFILE_S bounds it (150 s).
# The generated gRPC stubs (colibri_common/pb) must be there already (make setup makes them; carry them).
# Usage: OUT=dir bash benchmarks/gpu_check.sh [TEST_SECONDS] [BENCH_SECONDS]
set -u
OUT=${OUT:-gpu-check-out}
TEST_S=${1:-240}
BENCH_S=${2:-300}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/colibri-site \
        .whl/*.whl || exit 3
    export PYTHONPATH="$PWD:/tmp/colibri-site"
fi
PYEXE=$(python3 -c 'import sys; print(sys.executable)')
# the console script `pip install -e .` would write, where the tests and benchmarks look for it
printf '#!%s\nimport sys\nfrom colibri.cli import entry\nsys.exit(entry())\n' "$PYEXE" > "$(dirname "$PYEXE")/colibri"
chmod +x "$(dirname "$PYEXE")/colibri"

{ date -u; nvidia-smi; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c 'import torch, triton, transformers, grpc, google.protobuf as pb; print("torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__, "grpcio",
grpc.__version__, "protobuf", pb.__version__, "capability", torch.cuda.get_device_capability())'
  nproc; free -g; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
STEPS=" ${STEPS:-compile tests bench} "

if [[ $STEPS == *" compile "* ]]; then
echo "== gpu_compile"
timeout 120 python3 -m tests.kernels.gpu_compile > "$OUT/gpu_compile.log" 2>&1; echo "gpu_compile rc=$?"
grep -c "^ok" "$OUT/gpu_compile.log"; grep "^FAIL" "$OUT/gpu_compile.log" | head -5
fi

if [[ $STEPS == *" tests "* ]]; then
echo "== GPU tests"
# shellcheck disable=SC2086
timeout "$TEST_S" python3 -m pytest -q -n 8 -p no:cacheprovider -o addopts="" --timeout 180 -rfE ${PYTEST_ARGS:-} \
    tests/gpu > "$OUT/gpu-tests.log" 2>&1
echo "tests rc=$?"; tail -n 40 "$OUT/gpu-tests.log"
fi

if [[ $STEPS == *" profile "* ]]; then
echo "== profile"
# shellcheck disable=SC2086
timeout "${PROFILE_S:-150}" python3 -m benchmarks.gpu_profile ${PROFILE_ARGS:-} > "$OUT/profile.txt" 2>&1
echo "profile rc=$?"; grep -E "^###|Self CPU time total|Self CUDA time total" "$OUT/profile.txt"
fi

if [[ $STEPS == *" bench "* ]]; then
echo "== bench-gpu"
timeout "$BENCH_S" python3 -m benchmarks.gpu > "$OUT/bench-gpu.log" 2>&1
echo "bench rc=$?"; tail -n 50 "$OUT/bench-gpu.log"
cp benchmarks/results/gpu.md "$OUT/gpu.md" 2>/dev/null
fi
exit 0
