#!/usr/bin/env bash
# Install what bench/run.py needs beyond Kiln's own virtualenv (`make bench` runs this first):
#
#   * wrk, the HTTP load generator (Debian package; installed with apt-get when running as
#     root, otherwise the command to run is printed);
#   * the LiteLLM proxy in its own cached virtualenv (bench/litellm_env.sh).
#
# Both steps do nothing when already done.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"

if ! command -v wrk >/dev/null 2>&1; then
    if [[ "$(id -u)" != 0 ]]; then
        echo "bench: wrk is missing; install it with: sudo apt-get install -y wrk" >&2
        exit 1
    fi
    echo "bench: installing wrk (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine may have no package lists yet: update once if the first try fails.
    apt-get install -y -q wrk >&2 || { apt-get update -q >&2 && apt-get install -y -q wrk >&2; }
fi

bash "$here/litellm_env.sh" >/dev/null
