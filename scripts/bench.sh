#!/usr/bin/env bash
# Loopback throughput: this binding vs Mooncake's own Python binding vs memcpy
# (benches/transport.rs). Prints a markdown table. Extra arguments go to the
# benchmark: --rounds R --iters K (samples per cell = R x K), --spin.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo bench --quiet --bench transport -- "$@"
