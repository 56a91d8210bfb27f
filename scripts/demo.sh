#!/usr/bin/env bash
# The Trainyard demo: a 2-node dev cluster on this machine (2 virtual GPU slots per node), one
# tiny-gpt job submitted with curl and followed to the end, then the cluster is stopped. Midway, one
# worker is SIGKILLed (TRAINYARD_DEMO_KILL=0 skips that): the job comes back from its last committed
# checkpoint and ends with the weights it would have had anyway.
#
# Run through `make demo` (which creates the virtual environment first). Exit status 0 only when
# the job succeeded. The cluster is stopped on every way out: success, failure, Ctrl-C.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PORT="${TRAINYARD_DEMO_PORT:-8000}"
DATA_DIR="${TRAINYARD_DEMO_DIR:-.trainyard/demo}"
READY_TIMEOUT_S="${TRAINYARD_DEMO_READY_TIMEOUT_S:-180}"
JOB_TIMEOUT_S="${TRAINYARD_DEMO_JOB_TIMEOUT_S:-900}"
KILL_AT_STEP="${TRAINYARD_DEMO_KILL_AT_STEP:-130}"
[[ "${TRAINYARD_DEMO_KILL:-1}" == 0 ]] && KILL_AT_STEP=""
PY="${PYTHON:-python}"
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
TRAINYARD=(.venv/bin/trainyard)
[[ -x "${TRAINYARD[0]}" ]] || TRAINYARD=("$PY" -m trainyard)

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# JSON field access with python (always present), so the demo needs no jq.
json() { "$PY" -c 'import json, sys
doc = json.load(sys.stdin)
for key in sys.argv[1].split("."):
    doc = doc.get(key) if isinstance(doc, dict) else None
print("" if doc is None else doc)' "$1"; }
show() { printf '$ %s\n' "$*"; }

mkdir -p "$DATA_DIR"
OUT="$DATA_DIR/dev-up.out"

if ! "$PY" -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))' "$PORT" 2>/dev/null; then
    echo "demo: port $PORT on 127.0.0.1 is already in use (another dev cluster?)." >&2
    echo "      Stop whatever listens there, or run: TRAINYARD_DEMO_PORT=8010 make demo" >&2
    exit 2
fi

DEV_PID=""
stop_cluster() {
    local code=$?
    trap - EXIT INT TERM
    if [[ -n "$DEV_PID" ]] && kill -0 "$DEV_PID" 2>/dev/null; then
        say "stopping the cluster"
        kill -TERM "$DEV_PID" 2>/dev/null || true
        # dev up stops agents, control plane, S3 and Postgres in turn; give it time, then insist.
        for _ in $(seq 1 120); do
            kill -0 "$DEV_PID" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$DEV_PID" 2>/dev/null; then
            echo "demo: dev up did not stop in 60 s; killing it" >&2
            kill -KILL "$DEV_PID" 2>/dev/null || true
        fi
        wait "$DEV_PID" 2>/dev/null || true
    fi
    exit "$code"
}
trap stop_cluster EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say "starting the dev cluster (output: $OUT)"
show "${TRAINYARD[*]} dev up --nodes 2 --gpus-per-node 2 --port $PORT --data-dir $DATA_DIR"
: >"$OUT"  # truncated here, not in the background job: no stale TRAINYARD_READY line is read
"${TRAINYARD[@]}" dev up --nodes 2 --gpus-per-node 2 --port "$PORT" --data-dir "$DATA_DIR" >"$OUT" 2>&1 &
DEV_PID=$!

deadline=$((SECONDS + READY_TIMEOUT_S))
READY_LINE=""
while [[ -z "$READY_LINE" ]]; do
    READY_LINE="$(grep -m1 '^TRAINYARD_READY ' "$OUT" || true)"
    [[ -n "$READY_LINE" ]] && break
    if ! kill -0 "$DEV_PID" 2>/dev/null; then
        echo "demo: dev up exited before the cluster was ready:" >&2
        tail -n 30 "$OUT" >&2
        exit 1
    fi
    if ((SECONDS > deadline)); then
        echo "demo: the cluster was not ready after ${READY_TIMEOUT_S}s:" >&2
        tail -n 30 "$OUT" >&2
        exit 1
    fi
    sleep 0.5
done
URL="$(sed -n 's/.* url=\([^ ]*\).*/\1/p' <<<"$READY_LINE")"
TOKEN="$(sed -n 's/.* token=\([^ ]*\).*/\1/p' <<<"$READY_LINE")"
# The API is HTTPS, its certificate signed by the cluster's own CA: curl trusts that CA alone.
CA="$(sed -n 's/.* ca=\([^ ]*\).*/\1/p' <<<"$READY_LINE")"
CURL=(curl)
[[ -n "$CA" ]] && CURL=(curl --cacert "$CA")
sed -n '/^Trainyard dev cluster is up/,/^Press Ctrl-C/p' "$OUT"

say "submitting a job"
BODY='{"name": "tiny-gpt", "num_nodes": 2, "gpus_per_node": 2, "entrypoint": "worker_runtime.examples.tiny_gpt", "args": ["--steps", "300"], "checkpoint": {"interval_steps": 50}, "max_failures": 3}'
show "${CURL[*]} -sS -X POST $URL/v1/jobs -H 'Authorization: Bearer $TOKEN' -H 'Content-Type: application/json' -d '$BODY'"
SUBMIT="$("${CURL[@]}" -sS --fail-with-body -X POST "$URL/v1/jobs" \
    -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' -d "$BODY")" || {
    echo "demo: submit failed: $SUBMIT" >&2
    exit 1
}
JOB_ID="$(json id <<<"$SUBMIT")"
echo "job id: $JOB_ID"

say "following the job"
show "${CURL[*]} -sS $URL/v1/jobs/$JOB_ID -H 'Authorization: Bearer $TOKEN'"
deadline=$((SECONDS + JOB_TIMEOUT_S))
last=""
STATE=""
while :; do
    JOB="$("${CURL[@]}" -sS --fail-with-body "$URL/v1/jobs/$JOB_ID" -H "Authorization: Bearer $TOKEN")" || {
        echo "demo: could not read the job: $JOB" >&2
        exit 1
    }
    STATE="$(json state <<<"$JOB")"
    line="state=$STATE step=$(json progress.step <<<"$JOB") loss=$(json progress.loss <<<"$JOB")"
    line+=" attempt=$(json current_attempt.number <<<"$JOB") failures=$(json failures <<<"$JOB")"
    if [[ "$line" != "$last" ]]; then
        printf '%s  %s\n' "$(date +%T)" "$line"
        last="$line"
    fi
    step="$(json progress.step <<<"$JOB")"
    if [[ -n "$KILL_AT_STEP" && "$STATE" == running && "${step:-0}" -ge "$KILL_AT_STEP" ]]; then
        KILL_AT_STEP=""
        VICTIM="$("${CURL[@]}" -sS "$URL/v1/jobs/$JOB_ID/attempts" -H "Authorization: Bearer $TOKEN" | "$PY" -c 'import json, sys
workers = [w for n in json.load(sys.stdin)["items"][-1]["nodes"] for w in n["workers"] if w["state"] == "running"]
print(max(workers, key=lambda w: w["rank"])["pid"] if workers else "")')"
        if [[ -n "$VICTIM" ]]; then
            say "killing a worker (SIGKILL pid $VICTIM) to show recovery"
            kill -KILL "$VICTIM" 2>/dev/null || true
        fi
    fi
    case "$STATE" in
        succeeded | failed | cancelled) break ;;
    esac
    if ((SECONDS > deadline)); then
        echo "demo: the job did not finish in ${JOB_TIMEOUT_S}s" >&2
        exit 1
    fi
    if ! kill -0 "$DEV_PID" 2>/dev/null; then
        echo "demo: the dev cluster stopped while the job ran:" >&2
        tail -n 30 "$OUT" >&2
        exit 1
    fi
    sleep 2
done

say "result"
"$PY" -c 'import json, sys
job = json.load(sys.stdin)
print(json.dumps({k: job.get(k) for k in ("state", "end_reason", "failures", "progress", "result")}, indent=2))' <<<"$JOB"

say "attempts"
show "${CURL[*]} -sS $URL/v1/jobs/$JOB_ID/attempts -H 'Authorization: Bearer $TOKEN'"
"${CURL[@]}" -sS "$URL/v1/jobs/$JOB_ID/attempts" -H "Authorization: Bearer $TOKEN" | "$PY" -c 'import json, sys
for a in json.load(sys.stdin)["items"]:
    line = "attempt %s: %s" % (a["number"], a["outcome"])
    if a["outcome"] == "failed":
        line += " (%s)" % a["end_reason"]
    rec = a.get("recovery")
    if rec:
        line += "; restored step %s, %s steps lost, first new step %.1f s after the failure" % (
            a["restored_from_step"], rec["steps_lost"], rec["to_first_step_s"] or 0)
    print(line)'

say "last log lines"
show "${CURL[*]} -sS '$URL/v1/jobs/$JOB_ID/logs' -H 'Authorization: Bearer $TOKEN' | tail -n 8"
"${CURL[@]}" -sS "$URL/v1/jobs/$JOB_ID/logs" -H "Authorization: Bearer $TOKEN" | tail -n 8 || true

if [[ "$STATE" != succeeded ]]; then
    echo "demo: the job ended '$STATE' (logs of each process: $DATA_DIR/logs/)" >&2
    exit 1
fi
say "the job succeeded"

if [[ "${TRAINYARD_DEMO_KILL:-1}" != 0 ]]; then
    say "the same job under bare torchrun, never interrupted, for comparison"
    show "torchrun --standalone --nproc-per-node 4 -m worker_runtime.examples.tiny_gpt --steps 300"
    REFERENCE="$(env OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 TRAINYARD_DEVICE=cpu \
        "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 -m worker_runtime.examples.tiny_gpt \
        --steps 300 2>/dev/null | grep '^{' | tail -n 1)"
    OURS="$(json result.weights_sha256 <<<"$JOB")"
    THEIRS="$(json weights_sha256 <<<"$REFERENCE")"
    echo "weights_sha256 after recovery: $OURS"
    echo "weights_sha256 never failed:   $THEIRS"
    if [[ "$OURS" != "$THEIRS" ]]; then
        echo "demo: the recovered job's weights differ from the uninterrupted run's" >&2
        exit 1
    fi
    echo "identical: the job resumed exactly where it was"
fi
