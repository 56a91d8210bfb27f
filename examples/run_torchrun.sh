#!/usr/bin/env bash
# A job that brings its own launcher (docs/writing-jobs.md, "Jobs that bring their own launcher"):
# Trainyard runs this script once on every node, in place of its own torchrun, and the script starts
# torchrun itself with flags of its choosing. Everything it needs is in its environment: NNODES,
# NPROC_PER_NODE, NODE_RANK, MASTER_ADDR and MASTER_PORT (the attempt's own port on node rank 0),
# TRAINYARD_ATTEMPT_ID, TRAINYARD_LOCAL_ADDR. Its arguments go to the training script.
#
#     trainyard run examples/command.yaml -f
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
echo "node ${NODE_RANK}/${NNODES}: ${NPROC_PER_NODE} processes, rendezvous at ${MASTER_ADDR}:${MASTER_PORT}"
# exec: torchrun takes this process's place, so a stop (SIGTERM) reaches it directly, and its exit is
# the node's result. --max-restarts 0: recovery is Trainyard's (a new attempt from the last checkpoint).
exec python -m torch.distributed.run \
    --nnodes "${NNODES}" --nproc-per-node "${NPROC_PER_NODE}" --node-rank "${NODE_RANK}" \
    --rdzv-backend static --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}" --rdzv-id "${TRAINYARD_ATTEMPT_ID}" \
    --local-addr "${TRAINYARD_LOCAL_ADDR}" --max-restarts 0 --monitor-interval 0.5 \
    "${here}/train_minimal.py" "$@"
