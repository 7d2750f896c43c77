#!/usr/bin/env bash
# Runs every OrbitKV test against the real Mooncake engine (loopback and
# network namespaces), after setting up what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source scripts/env.sh

echo "== rustfmt, clippy"
cargo fmt --all -- --check
cargo clippy --quiet --all-targets -- -D warnings

echo "== Rust tests (unit, property, integration against real Mooncake)"
cargo test --all-targets 2>&1 | tee /tmp/orbitkv-cargo-test.log
