#!/usr/bin/env bash
# Builds .gpu-e2e/ (git-ignored): everything benches/gpu/e2e/run.sh needs to
# run real vLLM 0.26.0 (CUDA) with OrbitKV's PdConnector and vLLM's
# NixlConnector on the GPU device machine, which has no network and no package
# index (Python 3.12, torch 2.11.0+cu130). Run it HERE, from any directory:
#
#   benches/gpu/e2e/prepare.sh [--commit REV] [--part-mib N]
#
# --commit REV   the commit whose orbitkv wheel is built (default: HEAD). The
#                wheel is built from a clean checkout of that commit (a git
#                worktree, ORBITKV_E2E_WORKTREE, default /tmp/orbitkv-wheel-src),
#                never from the working tree, by that commit's own
#                benches/gpu/prepare.sh (which also makes the Mooncake, NIXL and
#                .deb bundle of the transport qualification, `.gpu/`).
# --site-only    only download and build the (cached) vLLM + wheels archive
# --part-mib N   the size of each part (default: 63 MiB less the repository's
#                files, since one device call carries at most 64 MiB, those included).
#
# What it carries (one payload, split into parts that go in consecutive device
# calls; docs/gpu-e2e.md says how):
#   site.tar.xz   one folder for PYTHONPATH: vllm==0.26.0 (CUDA wheel, slimmed:
#                 without vllm_flash_attn/_vllm_fa2_C.abi3.so (the H200 runs
#                 FlashAttention 3), _moe_C_stable_libtorch.abi3.so (MoE kernels,
#                 imported only if present), the vllm-rs binary,
#                 third_party/fmha_sm100, third_party/deep_gemm/include and
#                 deep_gemm's modules for Pythons other than 3.12) and the wheels of
#                 benches/gpu/e2e/device-wheels.txt, unpacked
#   transport/    mooncake-cuda13-*.tar.xz, nixl-cu13-*.tar.xz, debs/*.deb
#                 (from benches/gpu/prepare.sh of that commit)
#   orbitkv-*.whl the commit's wheel (abi3), carried in the last call
#
# Output: .gpu-e2e/p1 ... .gpu-e2e/pN, each holding one part and MANIFEST
# (sha256 of every part, of the payload and of the wheel), the last one also the
# wheel and BUILD_INFO; .gpu-e2e/CALLS.md lists the device calls to make.
# Downloads and the slow xz archive are cached (ORBITKV_GPU_CACHE, default
# /tmp/orbitkv-gpu-cache): a second run with the same inputs takes seconds.
# Needs: .venv (scripts/setup.sh: pip, maturin), cargo, git, xz, tar, unzip,
# apt-get, readelf, sha256sum.
set -euo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
COMMIT=HEAD
PART_MIB=auto
SITE_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) COMMIT=$2; shift 2 ;;
    --part-mib) PART_MIB=$2; shift 2 ;;
    --site-only) SITE_ONLY=1; shift ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "prepare: unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT=$ROOT/.gpu-e2e
CACHE=${ORBITKV_GPU_CACHE:-/tmp/orbitkv-gpu-cache}
E2E_CACHE=$CACHE/e2e
WT=${ORBITKV_E2E_WORKTREE:-/tmp/orbitkv-wheel-src}
VLLM_VERSION=0.26.0
WHEELS_TXT=$ROOT/benches/gpu/e2e/device-wheels.txt
PIP=(python3 -m pip)
[ -x "$ROOT/.venv/bin/pip" ] && PIP=("$ROOT/.venv/bin/pip")
# the device: CPython 3.12, x86_64, glibc 2.39
PLAT=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for n in 39 35 34 31 28 27 26 24 17 5; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
# left out of the vLLM wheel (paths inside it)
VLLM_DROP=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs
           vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm/include
           'vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so')

say() { echo "prepare-e2e: $*"; }
for tool in git xz tar unzip sha256sum split; do
  command -v "$tool" >/dev/null || { say "missing $tool"; exit 1; }
done
mkdir -p "$E2E_CACHE/wheels"

# 1. the commit, and its worktree --------------------------------------------------------------
SHA=$(git rev-parse --verify "$COMMIT^{commit}")
say "orbitkv commit: $(git log -1 --format='%h %s' "$SHA")"

# 2. vLLM and the wheels it needs there, unpacked into one folder, xz'd (cached) -------------------
say "downloading vllm==$VLLM_VERSION and $(grep -vc '^#' "$WHEELS_TXT") wheels (cached in $E2E_CACHE/wheels)"
"${PIP[@]}" download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$E2E_CACHE/wheels" \
  "vllm==$VLLM_VERSION" -r "$WHEELS_TXT"
# the wheels of this list only (the cache may hold others)
mapfile -t WHEELS < <(python3 - "$E2E_CACHE/wheels" "$WHEELS_TXT" "vllm==$VLLM_VERSION" <<'PY'
import os, re, sys
folder, listing, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
have = {}
for f in os.listdir(folder):
    if f.endswith(".whl"):
        name, ver = f.split("-")[:2]
        have.setdefault((norm(name), ver), os.path.join(folder, f))
specs = [l.strip() for l in open(listing) if l.strip() and not l.startswith("#")] + extra
for spec in specs:
    name, ver = spec.split("==")
    path = have.get((norm(name), ver))
    if not path:
        sys.exit(f"no wheel for {spec} in {folder}")
    print(path)
PY
)
[ "${#WHEELS[@]}" -eq $(( $(grep -vc '^#' "$WHEELS_TXT") + 1 )) ] || { say "wheels missing"; exit 1; }
KEY=$( { for w in "${WHEELS[@]}"; do sha256sum "$w" | cut -c1-64; done; printf '%s\n' "${VLLM_DROP[@]}"; echo v2; } | sha256sum | cut -c1-16)
SITE_XZ=$E2E_CACHE/site-$KEY.tar.xz
if [ -s "$SITE_XZ" ]; then
  say "site archive cached: $SITE_XZ"
else
  STAGE=$E2E_CACHE/stage-$KEY
  rm -rf "$STAGE"; mkdir -p "$STAGE/site"
  say "unpacking ${#WHEELS[@]} wheels into $STAGE/site"
  DEPS=(); for w in "${WHEELS[@]}"; do case "$(basename "$w")" in vllm-*) ;; *) DEPS+=("$w") ;; esac; done
  "${PIP[@]}" install -q --no-deps --no-compile --no-index --only-binary=:all: "${PLAT[@]}" \
    --target "$STAGE/site" "${DEPS[@]}"
  rm -rf "$STAGE/site/bin"
  unzip -q "$(printf '%s\n' "${WHEELS[@]}" | grep '/vllm-')" -d "$STAGE/site"
  for p in "${VLLM_DROP[@]}"; do
    # shellcheck disable=SC2086  # the last pattern is a glob
    (cd "$STAGE/site" && rm -rf $p)
  done
  test -f "$STAGE/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
  test -f "$STAGE/site/vllm/_C_stable_libtorch.abi3.so"
  find "$STAGE/site" -name __pycache__ -type d -prune -exec rm -rf {} +
  say "site: $(du -sh "$STAGE/site" | cut -f1) unpacked; xz -9 -T2 (about 10-20 minutes on 2 cores)"
  tar -C "$STAGE" --sort=name --owner=0 --group=0 -cf - site | xz -9 -T2 >"$SITE_XZ.tmp"
  mv "$SITE_XZ.tmp" "$SITE_XZ"
  rm -rf "$STAGE"
fi
say "site archive: $(du -h "$SITE_XZ" | cut -f1)"
[ "$SITE_ONLY" = 1 ] && exit 0

# 3. the orbitkv wheel + the transport bundle, from a clean checkout of the commit ---------------
if [ -e "$WT/.git" ]; then
  git -C "$WT" checkout -q --detach "$SHA"
  git -C "$WT" reset -q --hard "$SHA"
  git -C "$WT" clean -q -fdx -e .venv -e .gpu
else
  git worktree add -q --detach "$WT" "$SHA"
fi
[ "$(git -C "$WT" rev-parse HEAD)" = "$SHA" ]
[ -z "$(git -C "$WT" status --porcelain)" ] || { say "$WT is not clean"; git -C "$WT" status --short; exit 1; }
ln -sfn "$ROOT/.venv" "$WT/.venv"
say "building the wheel and transport bundle in $WT (its benches/gpu/prepare.sh; cargo target $E2E_CACHE/cargo-target)"
(cd "$WT" && CARGO_TARGET_DIR=$E2E_CACHE/cargo-target ORBITKV_GPU_CACHE=$CACHE ORBITKV_GPU_PARTS=1 bash benches/gpu/prepare.sh) \
  >"$E2E_CACHE/transport-prepare.log" 2>&1 || { tail -30 "$E2E_CACHE/transport-prepare.log"; exit 1; }
grep -E 'commit:|wheel:' "$WT/.gpu/BUILD_INFO"
WHEEL=$(ls "$WT"/.gpu/orbitkv-*.whl)

# 4. the payload and its parts ------------------------------------------------------------------
rm -rf "$OUT"
mkdir -p "$OUT"
PAY=$E2E_CACHE/payload
rm -rf "$PAY"; mkdir -p "$PAY/transport"
ln "$SITE_XZ" "$PAY/site.tar.xz" 2>/dev/null || cp "$SITE_XZ" "$PAY/site.tar.xz"
cp "$WT"/.gpu/mooncake-*.tar.xz "$WT"/.gpu/nixl-*.tar.xz "$PAY/transport/"
cp -r "$WT/.gpu/debs" "$PAY/transport/"
cp "$WT/.gpu/BUILD_INFO" "$PAY/transport/BUILD_INFO.transport"
tar -C "$PAY" --sort=name --owner=0 --group=0 -cf "$E2E_CACHE/payload.tar" .
PAYLOAD_BYTES=$(stat -c %s "$E2E_CACHE/payload.tar")
WHEEL_BYTES=$(stat -c %s "$WHEEL")
if [ "$PART_MIB" = auto ]; then
  # a device call carries at most 64 MiB: the part plus the repository's files
  # (tracked, and untracked but not ignored), with 1 MiB to spare
  T_B=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  U_B=$( (git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null || true) | tail -1 | cut -f1)
  REPO_B=$(( ${T_B:-0} + ${U_B:-0} ))
  PART_MIB=$(( 63 - (REPO_B + 1048575) / 1048576 ))
  say "part size: $PART_MIB MiB (the repository's files take $(( (REPO_B + 1048575) / 1048576 )) MiB of each call)"
fi
PART=$((PART_MIB * 1048576))
# the last part also carries the wheel
NPARTS=$(( (PAYLOAD_BYTES + WHEEL_BYTES + 65536 + PART - 1) / PART ))
rm -rf "$E2E_CACHE/split"; mkdir -p "$E2E_CACHE/split"
split -b "$PART" -d -a 2 --numeric-suffixes=1 "$E2E_CACHE/payload.tar" "$E2E_CACHE/split/part."
GOT=$(ls "$E2E_CACHE"/split/part.* | wc -l)
if [ "$GOT" -ne "$NPARTS" ]; then
  # the remainder and the wheel did not fit one part together: the wheel gets its own call
  NPARTS=$((GOT + 1))
fi
{
  echo "# OrbitKV GPU end-to-end bundle: $NPARTS device calls (parts 1..$NPARTS)"
  echo "commit $SHA"
  echo "nparts $NPARTS"
  echo "payload $(sha256sum "$E2E_CACHE/payload.tar" | cut -c1-64) $PAYLOAD_BYTES"
  for f in "$E2E_CACHE"/split/part.*; do echo "part $(basename "$f") $(sha256sum "$f" | cut -c1-64) $(stat -c %s "$f")"; done
  echo "wheel $(basename "$WHEEL") $(sha256sum "$WHEEL" | cut -c1-64) $WHEEL_BYTES"
} >"$E2E_CACHE/MANIFEST"
for i in $(seq 1 "$NPARTS"); do
  d=$OUT/p$i; mkdir -p "$d"
  cp "$E2E_CACHE/MANIFEST" "$d/"
  f=$(printf '%s/split/part.%02d' "$E2E_CACHE" "$i")
  [ -f "$f" ] && ln "$f" "$d/" 2>/dev/null || { [ -f "$f" ] && cp "$f" "$d/"; } || true
done
cp "$WHEEL" "$OUT/p$NPARTS/"
{
  echo "built: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
  echo "orbitkv commit: $SHA ($(git log -1 --format='%s' "$SHA" | cut -c1-100))"
  echo "vllm: $VLLM_VERSION (CUDA wheel, slimmed: ${VLLM_DROP[*]})"
  echo "site archive: $(basename "$SITE_XZ") $(stat -c %s "$SITE_XZ") bytes"
  sed 's/^/transport: /' "$WT/.gpu/BUILD_INFO"
} >"$OUT/p$NPARTS/BUILD_INFO"
rm -rf "$PAY" "$E2E_CACHE/payload.tar"

# 5. the calls -----------------------------------------------------------------------------------
TRACKED=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
UNTRACKED=$( (git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null || true) | tail -1 | cut -f1)
UNTRACKED=${UNTRACKED:-0}
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
{
  echo "# Device calls for the GPU end-to-end run (kind nvidia-h200-x2, or nvidia-h200: see the end), back to back"
  echo
  echo "Bundle of commit $SHA. Make the calls one right after the other: the machine"
  echo "is given back after about 30 s idle, and the stashed parts with it."
  echo
  for i in $(seq 1 "$NPARTS"); do
    sz=$(du -cb "$OUT/p$i" | tail -1 | cut -f1)
    tot=$((sz + TRACKED + UNTRACKED))
    if [ "$i" -lt "$NPARTS" ]; then
      echo "$i. \`bash benches/gpu/e2e/run.sh stash $i\`  carry [\".gpu-e2e/p$i\"]  ($(mib "$tot") in all)"
    else
      echo "$i. \`bash benches/gpu/e2e/run.sh start --deadline 1500 --watch 470\`  carry [\".gpu-e2e/p$i\"], timeout_s 600  ($(mib "$tot") in all; --deadline: the device seconds you can spend, less ~3 minutes)"
    fi
    [ "$tot" -le $((64 * 1048576)) ] || { say "call $i would move $(mib "$tot"): TOO BIG"; exit 1; }
  done
  echo "$((NPARTS + 1)). \`bash benches/gpu/e2e/run.sh watch --watch 560\`, timeout_s 600, no carry (repeat while the driver runs)"
  echo
  echo "One GPU (kind nvidia-h200: one engine, OrbitKV and vLLM's MooncakeConnector, five instances on GPU 0,"
  echo "the cancel storm first): the same calls, the last one as"
  echo "\`E2E_DRIVER_ARGS=\"--one-gpu --big-layers 16 --stages s-storm,b-default,c-default\" bash benches/gpu/e2e/run.sh start --deadline 1200 --watch 470\`"
} >"$OUT/CALLS.md"
cat "$OUT/p$NPARTS/BUILD_INFO" | head -4
cat "$E2E_CACHE/MANIFEST"
cat "$OUT/CALLS.md"
say "tracked files $(mib "$TRACKED"), untracked not ignored $(mib "$UNTRACKED")"
