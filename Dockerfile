# headrace image: both planes (the entry point picks one). For GPUs, build FROM a CUDA
# PyTorch image, e.g.  docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

WORKDIR /opt/headrace
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY controlplane ./controlplane
COPY dataplane ./dataplane
COPY kernels ./kernels
RUN python3 -m pip install --no-cache-dir .

EXPOSE 50051 50061
ENTRYPOINT ["headrace"]
CMD ["serve"]
