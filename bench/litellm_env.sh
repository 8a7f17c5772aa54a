#!/usr/bin/env bash
# Create (or reuse) a private virtualenv holding the LiteLLM proxy used as the
# comparison gateway by bench/run.py.
#
#   bench/litellm_env.sh            -> prints the venv's bin directory
#
# Env:
#   KILN_CACHE_DIR    cache root (default: $HOME/.cache/kiln)
#   LITELLM_VERSION   version to install (default: 1.108.7)
#   PYTHON            interpreter used to create the venv (default: python3)
set -euo pipefail

version="${LITELLM_VERSION:-1.108.7}"
cache="${KILN_CACHE_DIR:-$HOME/.cache/kiln}"
venv="$cache/bench/litellm-venv"
stamp="$venv/.litellm-version"
python="${PYTHON:-python3}"

if [[ -x "$venv/bin/litellm" && -f "$stamp" && "$(cat "$stamp")" == "$version" ]]; then
    echo "$venv/bin"
    exit 0
fi

echo "litellm_env: installing litellm[proxy]==$version into $venv" >&2
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip >&2
"$venv/bin/pip" install --quiet "litellm[proxy]==$version" >&2
echo "$version" > "$stamp"
echo "$venv/bin"
