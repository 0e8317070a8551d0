# headrace image: both planes (the command picks one: `headrace controlplane|dataplane|serve`).
#
#   CPU (default):  docker build -t headrace:cpu .
#   GPU:            docker build -t headrace:cuda \
#                     --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime .
#
# A base image that already has torch (the CUDA PyTorch images) keeps it; otherwise the CPU
# build of torch is installed from TORCH_INDEX_URL. docker-compose.yml builds both variants.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A virtual environment that still sees the base image's packages (its torch, if any).
RUN python3 -m venv --system-site-packages /opt/venv \
 && (python -c "import torch" 2>/dev/null \
     || python -m pip install --index-url "${TORCH_INDEX_URL}" torch)

WORKDIR /opt/headrace
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY cli ./cli
COPY common ./common
COPY controlplane ./controlplane
COPY dataplane ./dataplane
COPY kernels ./kernels
COPY client ./client
RUN python -m pip install '.[structured]' && headrace --help > /dev/null

# 50051 public gRPC (Inference, Admin, health, reflection); 50061 data plane step protocol;
# 9400 / 9401 Prometheus /metrics of the control plane / data plane.
EXPOSE 50051 50061 9400 9401
ENTRYPOINT ["headrace"]
# In a container the API must be reachable from outside it; set HEADRACE_API_TOKEN (or
# HEADRACE_API_TOKENS) and HEADRACE_ADMIN_TOKEN in its environment to protect it (serve passes
# them to its children), and add --metrics-host 0.0.0.0 for a Prometheus outside the container.
# (A comment after CMD's JSON array would turn it into a shell command: keep it on its own line.)
CMD ["serve", "--host", "0.0.0.0"]
