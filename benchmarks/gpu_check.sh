#!/usr/bin/env bash
# A GPU session's checks in one run, for a machine that is lent a CUDA GPU for minutes and cannot build the pinned
# virtualenv (no registry): the machine's own python3, torch and triton (the run reports their versions: they are
# that machine's, not requirements.txt's), with pytest, pytest-xdist, pytest-timeout, psutil, numpy and tqdm
# already there, and the pinned packages it lacks as wheels in .whl/, made where pip works with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl NAME==VERSION
# for grpcio, grpcio-health-checking, grpcio-reflection, protobuf, tokenizers, transformers, huggingface_hub, hf-xet,
# httpx2, httpcore2, truststore, starlette, uvicorn, httptools, setproctitle, prometheus_client, safetensors, click,
# anyio, idna, h11 and regex at requirements.txt's versions. The generated gRPC stubs (colibri_common/pb) must be
# there already (make setup makes them; carry them). Each step is bounded and logged under $OUT:
#   env      the GPU's facts and the packages' versions                            -> env.txt (always)
#   compile  the Triton kernels compiled for sm_80 / sm_90 to IR                   -> gpu_compile.log
#   tests    tests/gpu (kernels against float64, serving against transformers)      -> gpu-tests.log
#   profile  benchmarks.gpu_profile (where the fused MoE's and a step's time goes)  -> profile.txt
#   bench    make bench-gpu's script (fused MoE against the HBM roofline, tok/s)     -> gpu.md, bench-gpu.log
# STEPS="compile tests bench" by default, run in that order (profile before bench when asked for); PYTEST_ARGS
# narrows the tests (e.g. "-k bfloat16"), BENCH_ARGS the benchmark (e.g. "--shapes bench --tokens 1,32"),
# PROFILE_ARGS the profile (e.g. "--tokens 1 --streams 1"), PROFILE_S bounds it (150 s). Exit status 1 when a step failed or ran out of time (each step's in $OUT/status).
# Usage: OUT=dir bash benchmarks/gpu_check.sh [TEST_SECONDS] [BENCH_SECONDS]
set -u
cd "$(dirname "$0")/.." || exit 3
OUT=$(mkdir -p "${OUT:-gpu-check-out}" && cd "${OUT:-gpu-check-out}" && pwd) || exit 3
TEST_S=${1:-240}
BENCH_S=${2:-300}
STEPS=" ${STEPS:-compile tests bench} "
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" COLIBRI_REQUIRE_GPU=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/colibri-site \
        .whl/*.whl || exit 3
    export PYTHONPATH="$PWD:/tmp/colibri-site"
fi
: > "$OUT/status"
failed=0

step() {  # NAME SECONDS LOG COMMAND...: run bounded, record its exit status. timeout signals its whole process
          # group (the fleets a step started too), SIGKILL 15 s after SIGTERM
    local name=$1 seconds=$2 log=$3
    shift 3
    echo "== $name"
    timeout -k 15 "$seconds" "$@" > "$OUT/$log" 2>&1
    local rc=$?
    echo "$name rc=$rc" | tee -a "$OUT/status"
    [ "$rc" -eq 0 ] || failed=1
    return 0
}

{ date -u; nvidia-smi; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c 'import torch, triton, transformers, grpc, google.protobuf as pb; print("torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__, "grpcio",
grpc.__version__, "protobuf", pb.__version__, "capability", torch.cuda.get_device_capability())'
  nproc; free -g; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ $STEPS == *" compile "* ]]; then
    step compile 120 gpu_compile.log python3 -m tests.kernels.gpu_compile
    grep -c "^ok" "$OUT/gpu_compile.log"; grep "^FAIL" "$OUT/gpu_compile.log" | head -5
fi
if [[ $STEPS == *" tests "* ]]; then
    # shellcheck disable=SC2086
    step tests "$TEST_S" gpu-tests.log python3 -m pytest -q -n 8 -p no:cacheprovider -o addopts="" --timeout 180 \
        -rfE ${PYTEST_ARGS:-} tests/gpu
    grep -v "PytestBenchmarkWarning\|warner(" "$OUT/gpu-tests.log" | tail -n 30
fi
if [[ $STEPS == *" profile "* ]]; then
    # shellcheck disable=SC2086
    step profile "${PROFILE_S:-150}" profile.txt python3 -m benchmarks.gpu_profile ${PROFILE_ARGS:-}
    grep -E "^###|Self CPU time total|Self CUDA time total" "$OUT/profile.txt"
fi
if [[ $STEPS == *" bench "* ]]; then
    # shellcheck disable=SC2086
    step bench "$BENCH_S" bench-gpu.log python3 -m benchmarks.gpu --out "$OUT/gpu.md" ${BENCH_ARGS:-}
    tail -n 50 "$OUT/bench-gpu.log"
fi
exit "$failed"
