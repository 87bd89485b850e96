# Colibri image: `colibri` as the entrypoint, non-root, slim runtime.
#   CPU:  docker build -t colibri:0.1.0 .
#   CUDA: docker build --build-arg TORCH_FLAVOR=cu128 -t colibri:0.1.0-cu128 .
# The CUDA wheels of torch bundle the CUDA runtime, so one slim Python base serves both; the node needs the
# NVIDIA driver and device plugin (nvidia.com/gpu).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_FLAVOR=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/colibri
COPY requirements.txt ./
# runtime pins only: everything above the test/benchmark marker line
RUN sed '/^# --- test and benchmark only/,$d' requirements.txt > runtime.txt \
 && /opt/colibri/bin/pip install --index-url "https://download.pytorch.org/whl/${TORCH_FLAVOR}" \
        "$(grep '^torch==' runtime.txt)" \
 && /opt/colibri/bin/pip install -r runtime.txt
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY colibri ./colibri
COPY colibri_common ./colibri_common
COPY router_service ./router_service
COPY expert_service ./expert_service
COPY kernels ./kernels
RUN /opt/colibri/bin/python -m grpc_tools.protoc -Icolibri_common/pb=protos --python_out=. --grpc_python_out=. \
        colibri_common/pb/admin.proto colibri_common/pb/expert.proto colibri_common/pb/generation.proto \
 && /opt/colibri/bin/pip install --no-deps . \
 && /opt/colibri/bin/pip uninstall -y grpcio-tools

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 10001 colibri && useradd --uid 10001 --gid colibri --no-create-home --home-dir /tmp colibri
COPY --from=build /opt/colibri /opt/colibri
ENV PATH=/opt/colibri/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TRITON_CACHE_DIR=/tmp/triton OMP_WAIT_POLICY=PASSIVE
USER 10001:10001
EXPOSE 50051 50061 9090
ENTRYPOINT ["colibri"]
CMD ["--help"]
