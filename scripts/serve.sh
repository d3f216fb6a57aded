#!/usr/bin/env bash
# `make serve`: a local Prefect server (SQLite) on loopback, the work pools, the deployments of
# prefect.yaml, and a process worker. Stop everything with: scripts/serve.sh stop
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN=${VENV_BIN:-.venv/bin}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.prefect}
export PREFECT_API_URL=http://127.0.0.1:4200/api
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export MEGATRAIN_ROOT=$PWD
LOGS=runs/serve
mkdir -p "$LOGS"

if [ "${1:-start}" = "stop" ]; then
  for name in worker server; do
    [ -f "$LOGS/$name.pid" ] && kill -INT "$(cat "$LOGS/$name.pid")" 2>/dev/null || true
    rm -f "$LOGS/$name.pid"
  done
  exit 0
fi

if ! curl -fs "$PREFECT_API_URL/health" >/dev/null 2>&1; then
  setsid "$VENV_BIN/prefect" server start --host 127.0.0.1 --port 4200 >"$LOGS/server.log" 2>&1 &
  echo $! >"$LOGS/server.pid"
  for _ in $(seq 120); do curl -fs "$PREFECT_API_URL/health" >/dev/null 2>&1 && break; sleep 1; done
fi
curl -fs "$PREFECT_API_URL/health" >/dev/null || { echo "server did not start; see $LOGS/server.log"; exit 1; }

"$VENV_BIN/prefect" work-pool create megatrain-local --type process --overwrite >/dev/null
"$VENV_BIN/prefect" work-pool create megatrain-k8s --type kubernetes --overwrite \
  --base-job-template infra/k8s/base-job-template.json >/dev/null
"$VENV_BIN/prefect" --no-prompt deploy --all >"$LOGS/deploy.log" 2>&1 || { cat "$LOGS/deploy.log"; exit 1; }

if ! { [ -f "$LOGS/worker.pid" ] && kill -0 "$(cat "$LOGS/worker.pid")" 2>/dev/null; }; then
  setsid "$VENV_BIN/prefect" worker start --pool megatrain-local >"$LOGS/worker.log" 2>&1 &
  echo $! >"$LOGS/worker.pid"
fi
cat <<MSG
Prefect UI:      http://127.0.0.1:4200
deployments:     $("$VENV_BIN/prefect" deployment ls 2>/dev/null | grep -c '│ pretrain\|│ self-check' || true) registered (see: PREFECT_API_URL=$PREFECT_API_URL $VENV_BIN/prefect deployment ls)
run a campaign:  PREFECT_API_URL=$PREFECT_API_URL $VENV_BIN/prefect deployment run pretrain/local --watch
screenshot:      scripts/screenshot.sh http://127.0.0.1:4200/runs runs/serve/ui.png
stop:            scripts/serve.sh stop
MSG
