#!/usr/bin/env bash
# Sets up everything OrbitKV needs on a fresh Debian machine. Idempotent.
#   apt: libibverbs1 libnuma1 (Mooncake's runtime needs), iproute2 (netns tests)
#   .venv: the pinned Python packages (requirements/*.txt)
#   cargo: the crates (fetched by the build)
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

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.orbitkv-requirements
want=$(cat requirements/*.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pinned Python packages (requirements/*.txt)"
  .venv/bin/pip install -q --upgrade pip==25.3
  for req in requirements/*.txt; do
    .venv/bin/pip install -q -r "$req"
  done
  echo "$want" > "$stamp"
fi

echo "setup: building the Rust crates"
cargo build --quiet --all-targets
echo "setup: done (venv: $ROOT/.venv)"
