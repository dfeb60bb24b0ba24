#!/usr/bin/env bash
# Start proposer, verifier and gateway as separate background processes, wait until all three report
# SERVING (grpc.health.v1), send one real chat request through the `specdec` client (gRPC), print the
# streamed answer and the acceptance statistics, then one chat request through the official `openai` Python
# client against the gateway's OpenAI-compatible HTTP API, then stop everything (SIGTERM, wait; SIGKILL
# after a timeout).
#
#   scripts/run_all.sh ["PROMPT"]          (what `make run` runs)
#
# Environment:
#   PYTHON                   python of the venv (default .venv/bin/python)
#   SPECDEC_MODEL_DIR        folder with the default models (see shared/settings.py)
#   SPECDEC_TARGET_MODEL     target model (HF folder, .gguf folder or hub id); default: shared.settings
#   SPECDEC_DRAFT_MODEL      draft model for --kind draft-model; default: shared.settings
#   SPECDEC_EAGLE_HEAD       EAGLE head folder for --kind eagle; default: models/smollm2-135m-eagle
#   SPECDEC_PROPOSER_KIND    eagle (default: the repository's trained head), draft-model, ngram or suffix
#   SPECDEC_K                draft tokens per step (default 4)
#   SPECDEC_DRAFT_AHEAD      outcomes the proposer drafts ahead per sequence (default 0: off; docs/services.md)
#   SPECDEC_MAX_TREE_NODES   token trees of up to N nodes where the policy finds they pay (default 8; 0: chains only)
#   RUN_MAX_TOKENS           max tokens of the demo request (default 64)
#   RUN_STARTUP_TIMEOUT      seconds to wait for all services to be healthy (default 600)
#   RUN_GATEWAY_PORT / RUN_VERIFIER_PORT / RUN_PROPOSER_PORT   ports (default 50051 / 50052 / 50053)
#   RUN_HTTP_PORT            the gateway's OpenAI-compatible HTTP port (default 8000)
#   RUN_PROPOSER_METRICS_PORT / RUN_VERIFIER_METRICS_PORT   Prometheus endpoints read for the figures printed
#                            after the answers (default 9463 / 9464)
#   RUN_KEEP_LOGS=1          keep the log folder after a successful run
# Logs go to a temporary folder, shown (with the tail of each log) when something fails.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-.venv/bin/python}"
if [[ ! -x "$PYTHON" ]] && ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "run_all.sh: python '$PYTHON' not found (run: make setup)" >&2
  exit 1
fi
BIN="$(dirname "$PYTHON")"

PROMPT="${1:-Explain in two sentences what speculative decoding is.}"
KIND="${SPECDEC_PROPOSER_KIND:-eagle}"
K="${SPECDEC_K:-4}"
MAX_TOKENS="${RUN_MAX_TOKENS:-64}"
STARTUP_TIMEOUT="${RUN_STARTUP_TIMEOUT:-600}"
GATEWAY_PORT="${RUN_GATEWAY_PORT:-50051}"
VERIFIER_PORT="${RUN_VERIFIER_PORT:-50052}"
PROPOSER_PORT="${RUN_PROPOSER_PORT:-50053}"
HTTP_PORT="${RUN_HTTP_PORT:-8000}"
PROPOSER_METRICS_PORT="${RUN_PROPOSER_METRICS_PORT:-9463}"
VERIFIER_METRICS_PORT="${RUN_VERIFIER_METRICS_PORT:-9464}"
DRAFT_AHEAD="${SPECDEC_DRAFT_AHEAD:-0}"
MAX_TREE_NODES="${SPECDEC_MAX_TREE_NODES:-8}"
HOST=127.0.0.1

case "$KIND" in
  eagle | draft-model | ngram | suffix) ;;
  *) echo "run_all.sh: SPECDEC_PROPOSER_KIND must be eagle, draft-model, ngram or suffix, got '$KIND'" >&2; exit 2 ;;
esac

TARGET="$("$PYTHON" -c 'from shared.settings import default_target_model; print(default_target_model())')"
DRAFT="$("$PYTHON" -c 'from shared.settings import default_draft_model; print(default_draft_model())')"
HEAD="$("$PYTHON" -c 'from shared.settings import default_eagle_head; print(default_eagle_head())')"

LOGDIR="$(mktemp -d "${TMPDIR:-/tmp}/specdec-run.XXXXXX")"
NAMES=()
PIDS=()
OK=0

log() { echo "[run_all] $*" >&2; }

show_logs() {
  log "logs are in $LOGDIR"
  for f in "$LOGDIR"/*.log; do
    [[ -e "$f" ]] || continue
    echo "----- $(basename "$f") (last 40 lines) -----" >&2
    tail -n 40 "$f" >&2 || true
  done
}

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  # Stop in reverse start order: gateway, verifier, proposer. SIGTERM lets each one drain.
  local i pid
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    pid="${PIDS[$i]}"
    if kill -0 "$pid" 2>/dev/null; then
      log "stopping ${NAMES[$i]} (pid $pid)"
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  local deadline=$((SECONDS + 30))
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    pid="${PIDS[$i]}"
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      log "${NAMES[$i]} (pid $pid) did not stop within 30 s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  if [[ $OK -ne 1 ]]; then
    show_logs
    [[ $status -ne 0 ]] || status=1
  elif [[ "${RUN_KEEP_LOGS:-0}" == 1 ]]; then
    log "logs are in $LOGDIR"
  else
    rm -rf "$LOGDIR"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A console script from `pip install -e .` when present, else the same entry point through python.
start() {
  local name="$1" script="$2" module="$3"
  shift 3
  if [[ -x "$BIN/$script" ]]; then
    "$BIN/$script" "$@" >"$LOGDIR/$name.log" 2>&1 &
  else
    "$PYTHON" -c "import sys; from $module import main; sys.argv[0] = '$script'; main()" "$@" \
      >"$LOGDIR/$name.log" 2>&1 &
  fi
  NAMES+=("$name")
  PIDS+=($!)
  log "started $name (pid $!): $script $*"
}

port_busy() { (echo >"/dev/tcp/$HOST/$1") 2>/dev/null; }

wait_healthy() {
  local name="$1" address="$2" pid="$3" service="${4:-}" deadline=$((SECONDS + STARTUP_TIMEOUT))
  while true; do
    if "$PYTHON" -m gateway.health_probe "$address" --service "$service" >/dev/null 2>&1; then
      log "$name is SERVING on $address"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      log "$name exited before it became healthy"
      return 1
    fi
    if ((SECONDS >= deadline)); then
      log "$name is not healthy after ${STARTUP_TIMEOUT} s"
      return 1
    fi
    sleep 1
  done
}

for port in "$PROPOSER_PORT" "$VERIFIER_PORT" "$GATEWAY_PORT" "$HTTP_PORT" "$PROPOSER_METRICS_PORT" \
  "$VERIFIER_METRICS_PORT"; do
  if port_busy "$port"; then
    log "port $port is already in use on $HOST: stop what runs there or set RUN_*_PORT"
    exit 1
  fi
done

case "$KIND" in
  draft-model) DRAFTER="$DRAFT" ;;
  eagle) DRAFTER="$HEAD" ;;
  *) DRAFTER=- ;;
esac
log "target=$TARGET proposer_kind=$KIND draft=$DRAFTER k=$K"
log "logs: $LOGDIR"

PROPOSER_ARGS=(--kind "$KIND" --host "$HOST" --port "$PROPOSER_PORT" --metrics-port "$PROPOSER_METRICS_PORT")
[[ "$KIND" == draft-model ]] && PROPOSER_ARGS+=(--model "$DRAFT")
[[ "$KIND" == eagle ]] && PROPOSER_ARGS+=(--model "$HEAD" --target-model "$TARGET")
[[ "$KIND" == eagle || "$KIND" == draft-model ]] && PROPOSER_ARGS+=(--draft-ahead "$DRAFT_AHEAD")
start proposer specdec-proposer proposer_service.server "${PROPOSER_ARGS[@]}"
start verifier specdec-verifier verifier_service.server --model "$TARGET" --proposer "$HOST:$PROPOSER_PORT" \
  --num-speculative-tokens "$K" --max-tree-nodes "$MAX_TREE_NODES" --host "$HOST" --port "$VERIFIER_PORT" \
  --metrics-port "$VERIFIER_METRICS_PORT"
start gateway specdec-gateway gateway.server --verifiers "$HOST:$VERIFIER_PORT" --tokenizer "$TARGET" \
  --host "$HOST" --port "$GATEWAY_PORT" --http-port "$HTTP_PORT"

wait_healthy proposer "$HOST:$PROPOSER_PORT" "${PIDS[0]}"
wait_healthy verifier "$HOST:$VERIFIER_PORT" "${PIDS[1]}"
# The gateway's service status turns SERVING once it sees a healthy verifier (its readiness).
wait_healthy gateway "$HOST:$GATEWAY_PORT" "${PIDS[2]}" specdec.v1.Gateway

log "prompt (chat template applied): $PROMPT"
echo "----- answer -----"
CLIENT_ARGS=(--address "$HOST:$GATEWAY_PORT" --chat --max-tokens "$MAX_TOKENS" --timeout 600)
if [[ -x "$BIN/specdec" ]]; then
  "$BIN/specdec" "${CLIENT_ARGS[@]}" "$PROMPT"
else
  "$PYTHON" -m gateway.client "${CLIENT_ARGS[@]}" "$PROMPT"
fi
echo "------------------"
log "the same question through the official openai client: http://$HOST:$HTTP_PORT/v1"
echo "----- answer (openai client, HTTP) -----"
"$PYTHON" - "$HOST:$HTTP_PORT" "$PROMPT" "$MAX_TOKENS" <<'PY'
import sys

import openai

address, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=600)
model = client.models.list().data[0].id
reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
)
print(reply.choices[0].message.content)
usage = reply.usage
extra = usage.model_extra or {}
print(
    f"[{reply.choices[0].finish_reason}] prompt_tokens={usage.prompt_tokens} "
    f"completion_tokens={usage.completion_tokens} drafted={extra.get('drafted_tokens')} "
    f"accepted={extra.get('accepted_tokens')}"
)
PY
echo "----------------------------------------"
echo "----- speculation (the services' Prometheus endpoints) -----"
"$PYTHON" -m specdec_local.run_figures "$HOST:$VERIFIER_METRICS_PORT" "$HOST:$PROPOSER_METRICS_PORT"
echo "------------------------------------------------------------"
OK=1
log "done; stopping the services"
