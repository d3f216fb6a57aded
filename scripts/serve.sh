#!/usr/bin/env bash
# `make serve`: a local Prefect server (SQLite under .prefect/, never committed) on loopback, the
# work pools, the deployments of prefect.yaml, and a process worker.
# `make stop` (scripts/serve.sh stop): stops all of it, the flow runs and ranks the worker
# started included, waits, and fails if anything is left.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN=${VENV_BIN:-.venv/bin}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.prefect}
PORT=${MEGATRAIN_PREFECT_PORT:-4200}
export PREFECT_API_URL=http://127.0.0.1:$PORT/api
export PREFECT_UI_API_URL=$PREFECT_API_URL  # the UI in a browser talks to this same server
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export MEGATRAIN_ROOT=$PWD
LOGS=${MEGATRAIN_SERVE_DIR:-runs/serve}
mkdir -p "$LOGS"

# Every process under PID: its children first collected (before any dies and is re-parented),
# plus everything in its session (the worker's flow runs start torchrun in sessions of their own,
# which are children of the flow run, so the tree walk finds those).
tree() {
  local pid=$1 child
  echo "$pid"
  for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do tree "$child"; done
}
session() { ps -eo pid=,sid= | awk -v s="$1" '$2 == s {print $1}'; }
alive() { local pid; for pid in "$@"; do kill -0 "$pid" 2>/dev/null && echo "$pid"; done; true; }

stop() {
  local name pid pids=() left
  for name in worker server; do
    [ -f "$LOGS/$name.pid" ] || continue
    pid=$(cat "$LOGS/$name.pid")
    if kill -0 "$pid" 2>/dev/null; then
      pids+=($(tree "$pid") $(session "$pid"))
    fi
  done
  mapfile -t pids < <(printf '%s\n' "${pids[@]}" | sort -un | grep -v '^$' || true)
  if [ ${#pids[@]} -gt 0 ]; then
    # The worker and server shut down cleanly on SIGINT (a worker needs it twice while a flow
    # runs); whatever is still there after that gets SIGTERM, then SIGKILL.
    for signal in INT INT TERM KILL; do
      left=$(alive "${pids[@]}")
      [ -z "$left" ] && break
      kill -s "$signal" $left 2>/dev/null || true
      for _ in $(seq 20); do [ -z "$(alive $left)" ] && break; sleep 0.5; done
    done
  fi
  left=$(alive "${pids[@]}")
  if [ -n "$left" ]; then
    echo "make stop: still running after SIGKILL: $left" >&2
    exit 1
  fi
  rm -f "$LOGS/worker.pid" "$LOGS/server.pid"
  echo "stopped: ${#pids[@]} processes (server, worker, flow runs, ranks); none left"
}

if [ "${1:-start}" = "stop" ]; then
  stop
  exit 0
fi

if ! curl -fs "$PREFECT_API_URL/health" >/dev/null 2>&1; then
  setsid "$VENV_BIN/prefect" server start --host 127.0.0.1 --port "$PORT" >"$LOGS/server.log" 2>&1 &
  echo $! >"$LOGS/server.pid"
  for _ in $(seq 120); do curl -fs "$PREFECT_API_URL/health" >/dev/null 2>&1 && break; sleep 1; done
fi
curl -fs "$PREFECT_API_URL/health" >/dev/null || { echo "server did not start; see $LOGS/server.log"; exit 1; }

"$VENV_BIN/prefect" work-pool create megatrain-local --type process --overwrite >/dev/null
# The cluster deployment needs the image its flow pods run (`make image`, pushed to a registry
# the cluster pulls from): without MEGATRAIN_IMAGE it is not registered at all.
names=(--name local --name self-check-on-anomaly)
if [ -n "${MEGATRAIN_IMAGE:-}" ]; then
  "$VENV_BIN/prefect" work-pool create megatrain-k8s --type kubernetes --overwrite \
    --base-job-template infra/k8s/base-job-template.json >/dev/null
  names+=(--name cluster)
  cluster="pretrain/cluster (image $MEGATRAIN_IMAGE)"
else
  cluster="pretrain/cluster not registered (set MEGATRAIN_IMAGE to the image \`make image\` built)"
fi
"$VENV_BIN/prefect" --no-prompt deploy "${names[@]}" >"$LOGS/deploy.log" 2>&1 || { cat "$LOGS/deploy.log"; exit 1; }

if ! { [ -f "$LOGS/worker.pid" ] && kill -0 "$(cat "$LOGS/worker.pid")" 2>/dev/null; }; then
  setsid "$VENV_BIN/prefect" worker start --pool megatrain-local >"$LOGS/worker.log" 2>&1 &
  echo $! >"$LOGS/worker.pid"
fi
cat <<MSG
Prefect UI:      http://127.0.0.1:$PORT
deployments:     pretrain/local, self-check/self-check-on-anomaly; $cluster
new campaign:    PREFECT_API_URL=$PREFECT_API_URL $VENV_BIN/prefect deployment run pretrain/local --watch
resume one:      PREFECT_API_URL=$PREFECT_API_URL $VENV_BIN/prefect deployment run pretrain/local -p campaign_id=<id> --watch
stop:            make stop
MSG
