#!/usr/bin/env bash
# Runs every OrbitKV test against the real Mooncake engine (loopback and
# network namespaces), after setting up what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source scripts/env.sh

echo "== rustfmt, clippy"
cargo fmt --all -- --check
cargo clippy --quiet --workspace --all-targets -- -D warnings

echo "== Rust tests (unit, property, integration against real Mooncake)"
cargo test --all-targets 2>&1 | tee /tmp/orbitkv-cargo-test.log

echo "== Fuzzing the wire contract (coverage-guided, bounded: ORBITKV_FUZZ_SECONDS, default 60)"
./scripts/fuzz.sh

echo "== Python tests (the orbitkv package against real Mooncake)"
rc=0
python -m pytest bindings/python/tests -q -rs || rc=$?
if [ "$rc" -ne 0 ]; then
  # 5: pytest collected no tests, which is a failure here.
  [ "$rc" -eq 5 ] && echo "test.sh: pytest collected no tests in bindings/python/tests" >&2
  exit "$rc"
fi
