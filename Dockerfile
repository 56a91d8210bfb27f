# One image for the control plane, the node agent and the workers it starts.
#
#   docker build -t trainyard .
#   docker build --build-arg TORCH_INDEX_URL=<a PyTorch CUDA wheel index> -t trainyard .
#
# Torch comes from PyPI by default (its Linux wheels are CUDA builds); TORCH_INDEX_URL picks the
# wheel index of a specific CUDA version to match the nodes' drivers. (The CPU-only build pinned by
# constraints.txt is for development machines and CI, not for this image.)
FROM python:3.11-slim

ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app

RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" torch; fi

COPY pyproject.toml README.md ./
COPY control_plane control_plane
COPY node_agent node_agent
COPY worker_runtime worker_runtime
COPY trainyard trainyard
COPY migrations migrations

# Editable, so the packages stay in /app next to migrations/, which the control plane finds there.
RUN pip install -e ".[server,agent,worker]"

CMD ["trainyard", "--help"]
