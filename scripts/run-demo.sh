#!/usr/bin/env bash
# `make run`: the local model server, the gateway (gunicorn + gevent workers) on a SQLite file,
# a demo org with $5 of credits and a fresh key, then a ready curl line.
#
# However it ends, it stops what it started: Ctrl-C (INT), a closed terminal (HUP, or its
# terminal gone with no signal at all), a supervisor's or make's TERM, a failure of this
# script, or one of the two servers exiting.
# The gateway stops first (running streams get KILN_GRACEFUL_TIMEOUT seconds to finish and
# settle), then the model server. Should this script be killed outright (KILL), the kernel
# sends both servers TERM (a parent-death signal, util-linux setpriv).
#
# Env: KILN_RUN_DIR (state, default .run), KILN_MODEL_PORT (default 8081), KILN_BIND
# (default 127.0.0.1:8000), KILN_DATABASE_URL, KILN_MODELS, KILN_WORKERS, KILN_GRACEFUL_TIMEOUT.
set -euo pipefail
VENV=${1:-.venv}
STATE=${KILN_RUN_DIR:-.run}
MODEL_PORT=${KILN_MODEL_PORT:-8081}
mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)
export KILN_BIND=${KILN_BIND:-127.0.0.1:8000}
export KILN_DATABASE_URL=${KILN_DATABASE_URL:-sqlite:///$STATE/kiln.db}
export KILN_WORKERS=${KILN_WORKERS:-2}
export PROMETHEUS_MULTIPROC_DIR=$STATE/metrics
# Ctrl-C stops the demo gracefully: running streams get this long to finish and settle.
export KILN_GRACEFUL_TIMEOUT=${KILN_GRACEFUL_TIMEOUT:-10}
if [[ -z ${KILN_MODELS:-} ]]; then  # the demo catalog, pointed at this run's model server
  # and at the GGUF file it serves, whose vocabulary is Kiln's own tokenizer for the model
  gguf=$(scripts/model-server.sh gguf "$VENV")
  sed -e "s#127\.0\.0\.1:8081#127.0.0.1:$MODEL_PORT#g" \
      -e "/^id = \"smollm2-135m\"\$/a tokenizer = \"$gguf\"" \
      gateway/demo_models.toml >"$STATE/models.toml"
  export KILN_MODELS=$STATE/models.toml
fi
KILN="$VENV/bin/kiln"
# Servers run in sessions of their own, so that a terminal's Ctrl-C or hang-up reaches this
# script only, which stops them in order. (This shell has no job control, so its background
# children are no process-group leaders and setsid runs them without forking: $! is the
# server.) A parent-death signal covers the one ending no trap sees: this script killed.
SERVER=(setsid)
if command -v setpriv >/dev/null; then SERVER+=(setpriv --pdeathsig TERM); fi

pids=()
say() { echo "$@" 2>/dev/null || true; }  # the terminal may be gone (HUP) or the pipe closed

running() {  # PID: alive and not a zombie waiting to be reaped (Linux /proc)
  local stat
  read -r stat 2>/dev/null <"/proc/$1/stat" || return 1  # not $(<...): set -e exits on it
  stat=${stat##*) }
  [[ ${stat:0:1} != Z ]]
}

stop() {  # PID SECONDS: TERM, then KILL its whole process group (gunicorn's workers) if needed
  local pid=$1 ticks=$(($2 * 10))
  kill -TERM "$pid" 2>/dev/null || true
  while running "$pid" && ((ticks-- > 0)); do sleep 0.1; done
  if running "$pid"; then
    say "$pid did not stop within $2 s; killing it"
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local status=$?
  # Nothing may cut the stop short: a second Ctrl-C, the terminal going away, a closed pipe.
  trap '' INT TERM HUP PIPE
  set +e
  say; say "stopping..."
  # Newest first: the gateway lets running streams finish (and settle) while the model server
  # is still there to finish them; then the model server.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    stop "${pids[i]}" $((i == 0 ? 10 : KILN_GRACEFUL_TIMEOUT + 10))
  done
  exit "$status"
}
trap cleanup EXIT
# `exit` runs the EXIT trap; the status tells the caller which signal ended the demo.
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 141' PIPE
trap 'exit 143' TERM

wait_http() {  # URL SECONDS NAME PID
  for _ in $(seq "$(($2 * 5))"); do
    if ! running "$4"; then say "$3 exited; see $STATE/*.log" >&2; exit 1; fi
    if "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)" "$1" 2>/dev/null; then return 0; fi
    sleep 0.2
  done
  say "$3 did not start; see $STATE/*.log" >&2
  exit 1
}

in_use() {  # HOST:PORT: something accepts connections there already
  "$VENV/bin/python" -c "import socket, sys; host, port = sys.argv[1].rsplit(':', 1)
sys.exit(socket.socket().connect_ex((host, int(port))) != 0)" "$1"
}
# Another demo (or anything else) on a port would answer the readiness checks below in place
# of this run's servers: refuse before starting anything.
for addr in "127.0.0.1:$MODEL_PORT" "$KILN_BIND"; do
  if in_use "$addr"; then
    say "$addr is already in use (another make run?): stop it, or set KILN_MODEL_PORT / KILN_BIND" >&2
    exit 1
  fi
done

say "starting the model server (SmolLM2-135M on llama.cpp) on 127.0.0.1:$MODEL_PORT ..."
# Logs are appended to, each run under a line of its own: an earlier run's stay readable.
for log in model-server gateway; do echo "== make run, $(date -u +%FT%TZ)" >>"$STATE/$log.log"; done
"${SERVER[@]}" scripts/model-server.sh start "$VENV" "$MODEL_PORT" >>"$STATE/model-server.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$MODEL_PORT/v1/models" 120 "the model server" "${pids[0]}"

"$KILN" db upgrade >"$STATE/migrate.log" 2>&1
if ! "$KILN" credits show demo >/dev/null 2>&1; then
  "$KILN" org create demo >/dev/null
  "$KILN" credits grant demo 5.00 --note "make run demo credits" >/dev/null
fi
KEY=$("$KILN" key create demo --name "make run" 2>/dev/null | tail -n 1)

say "starting the gateway on http://$KILN_BIND ..."
"$KILN" sweep >/dev/null  # close what a previous run left open (a killed worker's leases)
# SIGINT is gunicorn's quick, unsettled exit; cleanup sends SIGTERM, the graceful stop that
# lets streams finish and settle.
"${SERVER[@]}" "$VENV/bin/gunicorn" -c deploy/gunicorn.conf.py gateway.wsgi:app >>"$STATE/gateway.log" 2>&1 &
pids+=($!)
wait_http "http://$KILN_BIND/readyz" 60 "the gateway" "${pids[1]}"

cat <<MSG || true

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
# Until a server exits on its own (a crash), or the terminal this started in goes away
# without a hang-up reaching this script (tmux kill-session signals make alone, and make does
# not pass it on); then the EXIT trap stops the rest.
had_tty=
if { : >/dev/tty; } 2>/dev/null; then had_tty=1; fi
while running "${pids[0]}" && running "${pids[1]}"; do
  if [[ -n $had_tty ]] && ! { : >/dev/tty; } 2>/dev/null; then exit 129; fi
  sleep 1 & wait $! || true  # a signal's trap runs at once, not after the sleep
done
status=0
for pid in "${pids[@]}"; do
  if ! running "$pid"; then wait "$pid" || status=$?; fi
done
say "a server exited (status $status); see $STATE/*.log" >&2
exit $((status == 0 ? 1 : status))
