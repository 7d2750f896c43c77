#!/usr/bin/env bash
# The main job on this machine: two Mooncake engines on loopback, a
# multi-layer KV region streamed layer by layer, what moved and how fast.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source scripts/env.sh
cargo run --quiet --release --example demo -- "$@"
