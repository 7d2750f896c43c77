#!/usr/bin/env bash
# The main job on this machine: real P/D with vLLM (CPU) on loopback. Makes a
# tiny random-weight model locally, starts a prefill and a decode vLLM server
# with OrbitKV's PdConnector and the proxy in front, sends a few requests and
# prints the completions, time to first token and where each request's trace
# is (python -m orbitkv.demo --help).
#
#   ./scripts/demo.sh --transport   the transport-only demo instead: two
#                                   Mooncake engines on loopback, a multi-layer
#                                   KV region streamed layer by layer
#                                   (cargo run --release --example demo)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source scripts/env.sh
if [ "${1:-}" = "--transport" ]; then
  shift
  exec cargo run --quiet --release --example demo -- "$@"
fi
exec python -m orbitkv.demo "$@"
