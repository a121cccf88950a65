# Strata image: `strata serve`, `strata gateway` and the rest of the CLI.
#
#   docker build -t strata:cpu .                                  # CPU (default)
#   docker build -t strata:cuda --build-arg FLAVOR=cuda .          # CUDA base image + CUDA torch
#
# FLAVOR picks the stage the image is built from (cpu or cuda); BuildKit builds only that one.
# Override CUDA_BASE / CUDA_TORCH_INDEX to match your driver. The model is not in the image:
# `strata serve` pulls the default model (or reads a path / s3:// URI) into STRATA_CACHE_DIR,
# a volume in deploy/compose.yaml and the Helm chart.
ARG FLAVOR=cpu
ARG CPU_BASE=python:3.11-slim
ARG CUDA_BASE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG TORCH_VERSION=2.13.0

FROM ${CPU_BASE} AS base-cpu
ARG TORCH_VERSION
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url https://download.pytorch.org/whl/cpu

FROM ${CUDA_BASE} AS base-cuda
ARG TORCH_VERSION
ARG CUDA_TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url "${CUDA_TORCH_INDEX}"

FROM base-${FLAVOR} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    STRATA_CACHE_DIR=/var/cache/strata
ARG EXTRAS=""
WORKDIR /opt/strata
# Dependencies first (a layer that survives source edits), then the package itself;
# EXTRAS=ray adds Ray for the KubeRay path (deploy/helm/strata, ray.enabled).
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt
COPY strata ./strata
RUN pip install --no-cache-dir --no-deps . \
 && if [ -n "${EXTRAS}" ]; then pip install --no-cache-dir ".[${EXTRAS}]"; fi \
 && useradd --system --uid 10001 --home-dir /var/cache/strata --create-home strata \
 && install -d -o strata -g strata -m 0700 /run/strata-keys
COPY deploy/docker/probe.py deploy/docker/drain.py deploy/docker/keys.py deploy/docker/entry.py \
     /opt/strata/
USER strata
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "/opt/strata/probe.py", "http://127.0.0.1:8000/health"]
# `strata ARGS`, with the keys the arguments name under STRATA_KEY_DIR made first when missing
# (from STRATA_API_KEYS, STRATA_ADMIN_KEYS, STRATA_INTERNAL_KEYS, else random): the default
# command starts keyed as it is. Read a made key with `docker exec ... cat /run/strata-keys/...`.
ENV STRATA_KEY_DIR=/run/strata-keys
ENTRYPOINT ["python", "/opt/strata/entry.py"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", \
     "--api-key-file", "/run/strata-keys/api.keys", \
     "--admin-key-file", "/run/strata-keys/admin.key", \
     "--internal-key-file", "/run/strata-keys/internal.key"]
