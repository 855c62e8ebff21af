# The sluicegate worker image: the platform (sluicegate, tasks, flows) on CPU. It runs the Prefect process
# worker and the flow runs it starts, the S3 -> Prefect event bridge, and, in docker/compose.yaml, the
# Prefect and MLflow servers too (one image, so client and server versions can never drift apart).
#   docker build -f docker/worker.Dockerfile --build-arg CODE_COMMIT=$(git rev-parse HEAD) -t sluicegate-worker .
#   docker run --rm sluicegate-worker sluicegate --help
# Code lives at /opt/sluicegate, where prefect.yaml's pull step sets the working directory of a flow run.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# The Makefile's TORCH_SPEC: the CPU wheel, installed first so nothing pulls a multi-GB CUDA build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Baked into SLUICEGATE_CODE_COMMIT: an image has no git checkout, and lineage records the commit.
ARG CODE_COMMIT=unknown
LABEL org.opencontainers.image.title="sluicegate-worker" \
      org.opencontainers.image.source="https://github.com/sluicegate/sluicegate" \
      org.opencontainers.image.revision="${CODE_COMMIT}"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLUICEGATE_CODE_COMMIT=${CODE_COMMIT} \
    SLUICEGATE_HOME=/var/lib/sluicegate \
    PREFECT_HOME=/var/lib/sluicegate/prefect \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1 \
    GX_ANALYTICS_ENABLED=false

WORKDIR /opt/sluicegate
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

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

# A fixed unprivileged user; its home (the state directory, a volume in compose) is the only place it writes.
RUN groupadd --system --gid 10001 sluicegate \
    && useradd --system --uid 10001 --gid sluicegate --home-dir /var/lib/sluicegate --shell /usr/sbin/nologin sluicegate \
    && mkdir -p /var/lib/sluicegate/prefect /srv/serving-repo \
    && chown -R sluicegate:sluicegate /var/lib/sluicegate /srv/serving-repo
USER 10001:10001

# No HEALTHCHECK here: the image plays several roles (worker, bridge, Prefect server, MLflow server) with
# different health endpoints; docker/compose.yaml gives each service its own.
CMD ["prefect", "worker", "start", "--pool", "sluicegate", "--type", "process", "--with-healthcheck"]
