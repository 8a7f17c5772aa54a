#!/usr/bin/env bash
# `make run`: the local model server, the gateway (gunicorn + gevent workers) on a SQLite file,
# a demo org with $5 of credits and a fresh key, then a ready curl line. Ctrl-C stops it all.
set -euo pipefail
VENV=${1:-.venv}
STATE=${KILN_RUN_DIR:-.run}
MODEL_PORT=${KILN_MODEL_PORT:-8081}
export KILN_BIND=${KILN_BIND:-127.0.0.1:8000}
export KILN_DATABASE_URL=${KILN_DATABASE_URL:-sqlite:///$PWD/$STATE/kiln.db}
export KILN_MODELS=${KILN_MODELS:-$PWD/gateway/demo_models.toml}
export KILN_WORKERS=${KILN_WORKERS:-2}
export PROMETHEUS_MULTIPROC_DIR=$PWD/$STATE/metrics
# Ctrl-C stops the demo gracefully: running streams get this long to finish and settle.
export KILN_GRACEFUL_TIMEOUT=${KILN_GRACEFUL_TIMEOUT:-10}
KILN="$VENV/bin/kiln"
mkdir -p "$STATE"

pids=()
cleanup() {
  trap - INT TERM EXIT
  echo; echo "stopping..."
  # Newest first: the gateway lets running streams finish (and settle) while the model server
  # is still there to finish them; then the model server.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
}
trap cleanup INT TERM EXIT

wait_http() {  # URL SECONDS NAME
  for _ in $(seq "$(( $2 * 5 ))"); do
    if "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)" "$1" 2>/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "$3 did not start; see $STATE/*.log" >&2; exit 1
}

echo "starting the model server (SmolLM2-135M on llama.cpp) on 127.0.0.1:$MODEL_PORT ..."
# Own sessions for both servers: Ctrl-C reaches this script only, which stops them in order.
setsid scripts/model-server.sh start "$VENV" "$MODEL_PORT" >"$STATE/model-server.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$MODEL_PORT/v1/models" 120 "the model server"

"$KILN" db upgrade >"$STATE/migrate.log" 2>&1
if ! "$KILN" credits show demo >/dev/null 2>&1; then
  "$KILN" org create demo >/dev/null
  "$KILN" credits grant demo 5.00 --note "make run demo credits" >/dev/null
fi
KEY=$("$KILN" key create demo --name "make run" 2>/dev/null | tail -n 1)

echo "starting the gateway on http://$KILN_BIND ..."
"$KILN" sweep >/dev/null  # close what a previous run left open (a killed worker's leases)
# In its own session, so that Ctrl-C (SIGINT: gunicorn's quick, unsettled exit) does not reach
# it; cleanup sends SIGTERM, the graceful stop that lets streams finish and settle.
setsid "$VENV/bin/gunicorn" -c deploy/gunicorn.conf.py gateway.wsgi:app >"$STATE/gateway.log" 2>&1 &
pids+=($!)
wait_http "http://$KILN_BIND/readyz" 60 "the gateway"

cat <<MSG

Kiln is up: gateway http://$KILN_BIND, model smollm2-135m, demo org "demo".
  credits: $("$KILN" credits show demo)
  API key: $KEY   (shown once)

Try it:
  curl -s -i http://$KILN_BIND/v1/chat/completions \\
    -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \\
    -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hello in five words."}], "max_tokens": 32}'

The kiln command needs the demo's database (the gateway's settings are KILN_* variables):
  export KILN_DATABASE_URL=$KILN_DATABASE_URL
  $KILN credits show demo     # balance after your requests
  $KILN credits reconcile     # every cent accounted for
Logs: $STATE/gateway.log (one JSON line per generation). Ctrl-C stops everything.
MSG
wait -n "${pids[@]}"
