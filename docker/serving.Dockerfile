# The sluicegate model server (KServe V2 gRPC) on NVIDIA's TensorRT image: TensorRT, CUDA and cuDNN come
# from the base; on top only the serving dependencies and the serving/ package.
#   docker build -f docker/serving.Dockerfile -t sluicegate-serving .
#   docker run --gpus all -p 8001:8001 -p 8000:8000 -v $PWD/repo:/models sluicegate-serving --repo /models
ARG TRT_IMAGE=nvcr.io/nvidia/tensorrt:25.01-py3
FROM ${TRT_IMAGE}

ARG CODE_COMMIT=unknown
LABEL org.opencontainers.image.title="sluicegate-serving" \
      org.opencontainers.image.source="https://github.com/sluicegate/sluicegate" \
      org.opencontainers.image.revision="${CODE_COMMIT}"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLUICEGATE_SERVING__HOST=0.0.0.0 \
    SLUICEGATE_SERVING__CACHE_DIR=/var/cache/sluicegate

WORKDIR /opt/sluicegate
COPY docker/serving-requirements.txt ./requirements.txt
RUN python3 -m pip install --no-cache-dir -r requirements.txt

COPY serving/ ./serving/
# The native gRPC front end (serving/native): grpc++ from the distribution, built here against this image's
# Python and numpy. The build tools stay: removing them with apt would take grpc++'s runtime libraries too.
# Not pinned (DL3008): the base image's tag pins the distribution release; exact package revisions would
# break the build at its next security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libxxhash-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m serving.native.build \
    && python3 -c "from serving.native import load; m, why = load(); assert m, why"

# A fixed unprivileged user; the model cache is the only place it writes.
RUN groupadd --system --gid 10001 sluicegate \
    && useradd --system --uid 10001 --gid sluicegate --home-dir /opt/sluicegate --shell /usr/sbin/nologin sluicegate \
    && mkdir -p /var/cache/sluicegate \
    && chown sluicegate:sluicegate /var/cache/sluicegate
USER 10001:10001

EXPOSE 8001 8000
# Readiness, not liveness: a container that never loads its models should show as unhealthy.
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health/ready', timeout=2).status == 200 else 1)"]

ENTRYPOINT ["python3", "-m", "serving"]
CMD ["--repo", "/models"]
