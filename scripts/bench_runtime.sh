#!/usr/bin/env bash
# Runtime benchmarks (issue 3): CPU per layer from Runtime::layer_ready to the
# transport's submit_write, notifications routed per second (criterion,
# benches/runtime.rs), and the memory of 10,000 request actors
# (benches/runtime_memory.rs). Both run over InstantTransport, a transport
# test double (benches/support/mod.rs): what is measured is the runtime, not
# Mooncake. Extra arguments go to criterion, e.g. a filter such as
# `forward_cpu`, or `--measurement-time 10`. Results: docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo bench --quiet --bench runtime_memory
cargo bench --quiet --bench runtime -- --warm-up-time 1 --measurement-time 3 "$@"
