# The sluicegate worker image for GPU training (the Prefect Kubernetes pool of
# infra/prefect/gpu-training-pool.json): the worker image's platform and pins (docker/worker.Dockerfile,
# the same docker/worker-requirements.txt) on CUDA torch, with TensorRT for the convert step's engines.
#   docker build -f docker/worker-gpu.Dockerfile --build-arg CODE_COMMIT=$(git rev-parse HEAD) -t sluicegate-worker-gpu .
#   docker run --rm --gpus all sluicegate-worker-gpu python -c "import torch, tensorrt; print(torch.cuda.is_available())"
#
# Why python:3.11-slim and pip wheels rather than NVIDIA's pytorch/tensorrt images: those ship Python
# 3.12 and their own torch build, while worker-requirements.txt is resolved (and tested) on Python 3.11
# with the Makefile's torch; CUDA, cuDNN and TensorRT come as pip wheels (nvidia-*, tensorrt-cu12-libs)
# and the driver from the node (NVIDIA Container Toolkit / device plugin), so no CUDA base is needed.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# The Makefile's TORCH_SPEC version, built for CUDA 12.8: the CUDA of the serving image's base
# (nvcr.io/nvidia/tensorrt:25.01-py3) and of the TensorRT wheel below, so torch and TensorRT share one
# CUDA major in the process and the node's driver needs only CUDA 12 (>= 570).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# The TensorRT of docker/serving.Dockerfile's base (25.01 ships 10.8.0.43): an engine (model.plan) only
# loads in the TensorRT version that built it, so the one built here is the one the server runs, with
# no rebuild at serving start-up.
ARG TENSORRT_VERSION=10.8.0.43
# Baked into SLUICEGATE_CODE_COMMIT: an image has no git checkout, and lineage records the commit.
ARG CODE_COMMIT=unknown
LABEL org.opencontainers.image.title="sluicegate-worker-gpu" \
      org.opencontainers.image.source="https://github.com/sluicegate/sluicegate" \
      org.opencontainers.image.revision="${CODE_COMMIT}"

# NVIDIA_DRIVER_CAPABILITIES: the container toolkit mounts the driver's compute libraries (CUDA) only
# when asked; NVIDIA's own images set it, python:slim does not. NVIDIA_VISIBLE_DEVICES is left to the
# device plugin (Kubernetes) or `--gpus` (docker), which pick the GPUs.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    SLUICEGATE_CODE_COMMIT=${CODE_COMMIT} \
    SLUICEGATE_HOME=/var/lib/sluicegate \
    PREFECT_HOME=/var/lib/sluicegate/prefect \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1 \
    GX_ANALYTICS_ENABLED=false

WORKDIR /opt/sluicegate
# torch and TensorRT first, pinned, so the requirements below cannot pull another build of either.
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
    && python -m pip install --no-cache-dir "tensorrt-cu12==${TENSORRT_VERSION}"

# Dependencies before code: this layer is rebuilt only when the pins change.
COPY docker/worker-requirements.txt ./requirements.txt
RUN python -m pip install --no-cache-dir -r requirements.txt

COPY pyproject.toml README.md prefect.yaml ./
COPY sluicegate/ ./sluicegate/
COPY tasks/ ./tasks/
COPY flows/ ./flows/
COPY serving/ ./serving/
# --no-deps: every dependency is pinned above; `pip check` fails the build if a pin no longer fits.
RUN python -m pip install --no-cache-dir --no-deps . \
    && python -m pip check \
    && rm -rf build ./*.egg-info

# The same fixed unprivileged user as the CPU image; its home is the only place it writes.
RUN groupadd --system --gid 10001 sluicegate \
    && useradd --system --uid 10001 --gid sluicegate --home-dir /var/lib/sluicegate --shell /usr/sbin/nologin sluicegate \
    && mkdir -p /var/lib/sluicegate/prefect \
    && chown -R sluicegate:sluicegate /var/lib/sluicegate
USER 10001:10001

# A Prefect Kubernetes worker runs this image per flow run with its own command (the pool's template);
# the CMD only serves `docker run` by hand.
CMD ["prefect", "flow-run", "execute"]
