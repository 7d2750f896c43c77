#!/usr/bin/env bash
# Builds .gpu/ (git-ignored): everything benches/gpu/run.sh needs on a GPU
# machine that has no network and no package index (the H200 device machine:
# Python 3.12, torch 2.11 + CUDA 13). Run it HERE, from any directory:
#
#   benches/gpu/prepare.sh
#
# and name `.gpu` in the device call's `carry`. Contents:
#   orbitkv-*-abi3-manylinux_*.whl   this working tree's Python package (maturin, release)
#   mooncake-cuda13-0.3.13.post1.tar.xz
#                                     from mooncake-transfer-engine-cuda13==0.3.13.post1
#                                     (cp312, manylinux x86_64): engine.so, __init__.py,
#                                     libasio.so, libetcd_wrapper.so, the libraries of
#                                     mooncake_transfer_engine_cuda13.libs/ that engine.so
#                                     needs, and the dist-info METADATA (so OrbitKV's
#                                     version check sees 0.3.13.post1)
#   nixl-cu13-1.5.1.tar.xz            nixl==1.5.1 + nixl-cu13==1.5.1 (cp312), slimmed to
#                                     the Python API, libnixl, the UCX plugin and the UCX
#                                     modules it needs (cuda, cma); EP libraries, storage
#                                     and other plugins, tools and headers removed
#   debs/*.deb                        libibverbs1 libnuma1 ibverbs-providers (Mooncake's
#                                     engine.so needs libibverbs.so.1, libnuma.so.1, libmlx5.so.1)
#   BUILD_INFO                        commit, sizes, sha256 of the above
#
# Downloads are cached outside the repo (ORBITKV_GPU_CACHE, default
# /tmp/orbitkv-gpu-cache). Needs: .venv (scripts/setup.sh), cargo, apt-get,
# readelf, xz. Nothing in .gpu is committed (.gitignore: /.gpu/).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=$ROOT/.gpu
CACHE=${ORBITKV_GPU_CACHE:-/tmp/orbitkv-gpu-cache}
PIP=$ROOT/.venv/bin/pip
MATURIN=$ROOT/.venv/bin/maturin
PY=$ROOT/.venv/bin/python
MOONCAKE_DIST=mooncake-transfer-engine-cuda13
MOONCAKE_VERSION=0.3.13.post1
NIXL_VERSION=1.5.1
LIMIT_MIB=55
# the device runs CPython 3.12 on x86_64 Linux (glibc 2.39 was seen there)
TARGET=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

say() { echo "prepare: $*"; }
for tool in "$PIP" "$MATURIN" readelf xz tar apt-get unzip; do
  command -v "$tool" >/dev/null || { say "missing $tool (run scripts/setup.sh; apt-get install binutils xz-utils unzip)"; exit 1; }
done

rm -rf "$OUT"
mkdir -p "$OUT/debs" "$CACHE"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT

# (a) the orbitkv wheel ----------------------------------------------------------
say "building the orbitkv wheel (maturin, release) from the working tree"
"$MATURIN" build --release -m bindings/python/Cargo.toml -o "$STAGE/wheel" >"$STAGE/maturin.log" 2>&1 \
  || { tail -30 "$STAGE/maturin.log"; exit 1; }
WHEEL=$(ls "$STAGE"/wheel/orbitkv-*.whl)
case "$(basename "$WHEEL")" in
  *-abi3-manylinux_*_x86_64.whl) ;;
  *) say "unexpected wheel tag: $(basename "$WHEEL") (want abi3 and manylinux x86_64)"; exit 1 ;;
esac
cp "$WHEEL" "$OUT/"
WHEEL_TAG=$(basename "$WHEEL" .whl | cut -d- -f3-)
# the highest glibc symbol version the native module needs: the device's glibc must be >= it
unzip -q -o "$WHEEL" 'orbitkv/_native*.so' -d "$STAGE/wheel-x"
GLIBC_NEED=$(readelf -W --dyn-syms "$STAGE"/wheel-x/orbitkv/_native*.so | grep -o 'GLIBC_[0-9.]*' | sort -V -u | tail -1)
say "wheel $(basename "$WHEEL"): tag $WHEEL_TAG, needs $GLIBC_NEED"

# (b) Mooncake, CUDA 13 --------------------------------------------------------------
MC_WHL=$(ls "$CACHE"/mooncake_transfer_engine_cuda13-"$MOONCAKE_VERSION"-cp312-*.whl 2>/dev/null | head -1 || true)
if [ -z "$MC_WHL" ]; then
  say "downloading $MOONCAKE_DIST==$MOONCAKE_VERSION (cp312, ~98 MB)"
  "$PIP" download -q "${TARGET[@]}" -d "$CACHE" "$MOONCAKE_DIST==$MOONCAKE_VERSION"
  MC_WHL=$(ls "$CACHE"/mooncake_transfer_engine_cuda13-"$MOONCAKE_VERSION"-cp312-*.whl | head -1)
fi
mkdir -p "$STAGE/mc"
unzip -q "$MC_WHL" -d "$STAGE/mc"
MC_INFO=mooncake_transfer_engine_cuda13-$MOONCAKE_VERSION.dist-info
grep -q "^Name: $MOONCAKE_DIST\$" "$STAGE/mc/$MC_INFO/METADATA"
grep -q "^Version: $MOONCAKE_VERSION\$" "$STAGE/mc/$MC_INFO/METADATA"
say "slimming $(basename "$MC_WHL")"
"$PY" benches/gpu/slim.py "$STAGE/mc" mooncake/engine.so \
  --keep mooncake/__init__.py mooncake/libasio.so mooncake/libetcd_wrapper.so "$MC_INFO/METADATA" \
  | grep -v '^  kept'
for f in mooncake/engine.so mooncake/libasio.so mooncake/libetcd_wrapper.so; do
  test -f "$STAGE/mc/$f" || { say "slim lost $f"; exit 1; }
done
tar -C "$STAGE/mc" -cf - . | xz -9 -T2 >"$OUT/mooncake-cuda13-$MOONCAKE_VERSION.tar.xz"

# (c) system libraries Mooncake's engine.so needs --------------------------------------
say "apt-get download libibverbs1 libnuma1 ibverbs-providers"
if ! (cd "$OUT/debs" && apt-get download -q libibverbs1 libnuma1 ibverbs-providers >/dev/null 2>&1); then
  apt-get update -qq
  (cd "$OUT/debs" && apt-get download -q libibverbs1 libnuma1 ibverbs-providers >/dev/null 2>&1)
fi
ls "$OUT"/debs/libibverbs1_*.deb "$OUT"/debs/libnuma1_*.deb "$OUT"/debs/ibverbs-providers_*.deb >/dev/null

# (d) NIXL 1.5.1 (CUDA 13), for the comparison ---------------------------------------
if ! ls "$CACHE"/nixl_cu13-"$NIXL_VERSION"-cp312-*.whl >/dev/null 2>&1; then
  say "downloading nixl-cu13==$NIXL_VERSION (cp312, ~59 MB)"
  "$PIP" download -q "${TARGET[@]}" -d "$CACHE" "nixl-cu13==$NIXL_VERSION"
fi
if ! ls "$CACHE"/nixl-"$NIXL_VERSION"-py3-none-any.whl >/dev/null 2>&1; then
  "$PIP" download -q --no-deps --only-binary=:all: -d "$CACHE" "nixl==$NIXL_VERSION"
fi
mkdir -p "$STAGE/nixl"
unzip -q "$(ls "$CACHE"/nixl_cu13-"$NIXL_VERSION"-cp312-*.whl | head -1)" -d "$STAGE/nixl"
unzip -q -o "$CACHE/nixl-$NIXL_VERSION-py3-none-any.whl" -d "$STAGE/nixl"
say "slimming nixl-cu13 to the UCX backend"
(cd "$STAGE/nixl" && "$PY" "$ROOT/benches/gpu/slim.py" . \
  nixl_cu13/_bindings.cpython-312-x86_64-linux-gnu.so nixl_cu13/_utils.cpython-312-x86_64-linux-gnu.so \
  .nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so nixl_cu13.libs/nixl/libplugin_UCX.so \
  nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0 nixl_cu13.libs/ucx/libucm_cuda.so.0.0.0 nixl_cu13.libs/ucx/libuct_cma.so.0.0.0 \
  --keep nixl nixl_meta_utils.py nixl_cu13/__init__.py nixl_cu13/_api.py nixl_cu13/logging.py \
         "nixl-$NIXL_VERSION.dist-info/METADATA" "nixl_cu13-$NIXL_VERSION.dist-info/METADATA") | grep -v '^  kept'
tar -C "$STAGE/nixl" -cf - . | xz -9 -T2 >"$OUT/nixl-cu13-$NIXL_VERSION.tar.xz"

# sizes, and what one device call carries ------------------------------------------------
{
  echo "built: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src bindings Cargo.toml Cargo.lock build.rs 2>/dev/null || echo ' + uncommitted changes in src/bindings')"
  echo "wheel: $(basename "$WHEEL") (tag $WHEEL_TAG; highest glibc symbol $GLIBC_NEED)"
  echo "mooncake: $MOONCAKE_DIST==$MOONCAKE_VERSION from $(basename "$MC_WHL")"
  echo "nixl: nixl==$NIXL_VERSION, nixl-cu13==$NIXL_VERSION (cp312)"
  echo "files:"
  (cd "$OUT" && find . -type f ! -name BUILD_INFO -printf '%P\n' | sort | while read -r f; do
     printf '  %10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-16)" "$f"; done)
} >"$OUT/BUILD_INFO"
cat "$OUT/BUILD_INFO"
BUNDLE=$(du -cb "$OUT" | tail -1 | cut -f1)
TRACKED=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
UNTRACKED=$( (git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null || true) | tail -1 | cut -f1)
UNTRACKED=${UNTRACKED:-0}
TOTAL=$((BUNDLE + TRACKED + UNTRACKED))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
say ".gpu: $(mib "$BUNDLE"); tracked files: $(mib "$TRACKED"); untracked, not ignored: $(mib "$UNTRACKED")"
say "one device call with carry [\".gpu\"] moves about $(mib "$TOTAL") (limit 64 MiB)"
if [ "$BUNDLE" -gt $((LIMIT_MIB * 1048576)) ] || [ "$TOTAL" -gt $((64 * 1048576)) ]; then
  # ORBITKV_GPU_PARTS=1 (benches/gpu/e2e/prepare.sh): the caller splits the
  # bundle into calls of its own, so one call's limit is not this run's.
  if [ "${ORBITKV_GPU_PARTS:-0}" = 1 ]; then
    say "more than one call carries; the caller splits it into parts (ORBITKV_GPU_PARTS)"
  else
    say "TOO BIG for one call (the repository's tracked files alone: $(mib "$TRACKED"))"; exit 1
  fi
fi
say "done: run on the device with   bash benches/gpu/run.sh   and carry [\".gpu\"]"
