# syntax=docker/dockerfile:1.7
# The redline worker on a CUDA runtime image. Build and run: docker compose up --build (docs/deploy.md).
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

# python3-dev and gcc: Triton compiles its small launcher stubs on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface
RUN python3 -m venv /opt/venv

WORKDIR /app
COPY . .
# The same install command as the README's; the cache mount keeps pip's download cache out of the image.
RUN --mount=type=cache,target=/root/.cache/pip pip install -e .

# Gives each replica its own GPU when several replicas share a host (docker compose --scale worker=N):
# a replica takes an exclusive lock per GPU UUID in a directory all replicas share and holds it for its
# lifetime (the kernel drops it when the process exits); with every GPU taken it waits for one to free.
COPY --chmod=755 <<'SCRIPT' /usr/local/bin/redline-entrypoint
#!/bin/bash
set -euo pipefail
lock_dir="${REDLINE_GPU_LOCK_DIR:-}"
want="${REDLINE_GPUS_PER_WORKER:-1}"
if [[ -z "$lock_dir" || -n "${CUDA_VISIBLE_DEVICES:-}" ]] || ! command -v nvidia-smi >/dev/null; then
    exec "$@"
fi
mkdir -p "$lock_dir"
while true; do
    chosen=() held=()
    for uuid in $(nvidia-smi --query-gpu=uuid --format=csv,noheader); do
        exec {fd}>"$lock_dir/$uuid.lock"
        if flock -n "$fd"; then
            chosen+=("$uuid") held+=("$fd")
            (( ${#chosen[@]} == want )) && break
        else
            exec {fd}>&-
        fi
    done
    if (( ${#chosen[@]} == want )); then
        CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${chosen[*]}")
        export CUDA_VISIBLE_DEVICES
        echo "redline-entrypoint: using GPU(s) $CUDA_VISIBLE_DEVICES" >&2
        exec "$@"
    fi
    for fd in "${held[@]}"; do exec {fd}>&-; done
    echo "redline-entrypoint: waiting for $want free GPU(s) in $lock_dir" >&2
    sleep "${REDLINE_GPU_WAIT_SECONDS:-5}"
done
SCRIPT

RUN useradd --create-home --uid 10001 redline \
    && mkdir -p /cache/huggingface /run/redline-gpus \
    && chown -R redline:redline /cache /run/redline-gpus
USER redline

ENTRYPOINT ["/usr/local/bin/redline-entrypoint"]
CMD ["redline", "worker"]
