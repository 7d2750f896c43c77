#!/usr/bin/env bash
# OrbitKV end to end with real vLLM on the GPU device machine (kind
# nvidia-h200-x2), from the repository root, with the bundle that
# benches/gpu/e2e/prepare.sh built here (.gpu-e2e/p1 ... pN). The bundle does
# not fit one call, so it goes in consecutive calls, one part each, BACK TO
# BACK (the machine is given back after ~30 s idle, and what was stashed with it):
#
#   bash benches/gpu/e2e/run.sh stash K              carry [".gpu-e2e/pK"]   (K = 1 .. N-1)
#   bash benches/gpu/e2e/run.sh start [--deadline S] [--watch S]
#                                                    carry [".gpu-e2e/pN"]   (the last part + the wheel)
#   bash benches/gpu/e2e/run.sh watch [--watch S]    no carry; again while the driver runs
#
# .gpu-e2e/CALLS.md lists the exact calls. `stash` keeps part K under
# $E2E_ROOT/stash (default /root/orbitkv-e2e) and checks by sha256 that the
# earlier parts are still there (a fresh machine would have lost them: it then
# exits 3 and says so). `start` checks every part, assembles the bundle into
# $E2E_ROOT (site/ on PYTHONPATH: vLLM 0.26.0, its dependencies and orbitkv;
# Mooncake, NIXL, Debian libraries), runs a pre-flight import, records the
# machine, then starts benches/gpu/e2e/driver.py in its own session (setsid: it
# outlives this call while the machine stays warm) with a deadline of S seconds
# (default 1080), and watches it. `watch` follows it for up to S seconds (default
# 540) or until it ends. Both end by copying what exists into $OUT (at most 8
# files): progress.log, summary.md, results.tar.xz (every stage's JSON and
# vLLM's benchmark files), logs.tar.xz (every server, proxy and client log,
# each cut to its last 3 MB), env.txt, driver.log.
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
E2E_ROOT=${E2E_ROOT:-/root/orbitkv-e2e}
STASH=$E2E_ROOT/stash
OUT=${OUT:-$ROOT/bench-results/gpu-e2e}
PY=${E2E_PYTHON:-python3}
T0=$(date +%s)
mkdir -p "$STASH" "$OUT"
say() { echo "[run.sh $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }

mode=${1:-}
shift || true
WATCH=540
DEADLINE=1080
K=
while [ $# -gt 0 ]; do
  case "$1" in
    --watch) WATCH=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    [0-9]*) K=$1; shift ;;
    *) say "unknown argument $1"; exit 2 ;;
  esac
done

# the manifest: from the carried part, else the stash
manifest() {
  local m
  m=$(ls .gpu-e2e/p*/MANIFEST 2>/dev/null | head -1)
  [ -n "$m" ] && cp "$m" "$STASH/MANIFEST"
  [ -f "$STASH/MANIFEST" ] || { say "no MANIFEST carried or stashed"; exit 2; }
  echo "$STASH/MANIFEST"
}

# check_parts FIRST LAST: every part in the stash, by sha256
check_parts() {
  local ok=0 i name sha size got
  for i in $(seq "$1" "$2"); do
    name=$(printf 'part.%02d' "$i")
    read -r sha size < <(awk -v n="$name" '$1 == "part" && $2 == n {print $3, $4}' "$MAN")
    [ -n "$sha" ] || continue   # a last call that carries only the wheel
    if [ ! -f "$STASH/$name" ]; then
      say "part $i ($name): MISSING from $STASH (a fresh machine?): make the calls again from part 1"; ok=3
      continue
    fi
    got=$(sha256sum "$STASH/$name" | cut -c1-64)
    if [ "$got" = "$sha" ]; then
      say "part $i ($name): present, $size bytes, sha256 ${sha:0:16}... OK"
    else
      say "part $i ($name): sha256 MISMATCH ($got, want $sha)"; ok=3
    fi
  done
  return $ok
}

stash_carried() {
  local d
  for d in .gpu-e2e/p*; do
    [ -d "$d" ] || continue
    for f in "$d"/part.* "$d"/orbitkv-*.whl "$d"/BUILD_INFO; do
      [ -f "$f" ] || continue
      cp "$f" "$STASH/" && say "stashed $(basename "$f") from $d ($(stat -c %s "$f") bytes)"
    done
  done
}

collect() {
  # what exists, into $OUT (8 files at most)
  local R=$E2E_ROOT/results
  [ -d "$R" ] || return 0
  PYTHONPATH=$E2E_ROOT/site "$PY" "$E2E_ROOT/bin/driver.py" --report "$R" >/dev/null 2>&1 || true
  cp "$R/progress.log" "$R/summary.md" "$OUT/" 2>/dev/null
  (cd "$E2E_ROOT" && tar -cf - --exclude='*.tmp' results work/bench 2>/dev/null | xz -T0 -6 >"$OUT/results.tar.xz")
  rm -rf "$E2E_ROOT/logcut"; mkdir -p "$E2E_ROOT/logcut"
  for f in "$E2E_ROOT"/work/logs/*.log "$E2E_ROOT"/driver.log; do
    [ -f "$f" ] && tail -c 3000000 "$f" >"$E2E_ROOT/logcut/$(basename "$f")"
  done
  (cd "$E2E_ROOT" && tar -cf - logcut | xz -T0 -6 >"$OUT/logs.tar.xz")
  cp "$E2E_ROOT/env.txt" "$OUT/" 2>/dev/null
  tail -c 2000000 "$E2E_ROOT/driver.log" >"$OUT/driver.log" 2>/dev/null
  say "collected into \$OUT: $(ls "$OUT" | tr '\n' ' ')"
}

watch() {
  local until=$(( $(date +%s) + $1 )) pid seen=0 n
  pid=$(cat "$E2E_ROOT/driver.pid" 2>/dev/null || echo 0)
  while :; do
    if [ -f "$E2E_ROOT/results/progress.log" ]; then
      n=$(wc -l <"$E2E_ROOT/results/progress.log")
      [ "$n" -gt "$seen" ] && sed -n "$((seen + 1)),${n}p" "$E2E_ROOT/results/progress.log" && seen=$n
    fi
    if [ "$pid" = 0 ] || ! kill -0 "$pid" 2>/dev/null; then
      say "driver (pid $pid) has ended"; tail -5 "$E2E_ROOT/driver.log" 2>/dev/null; break
    fi
    [ "$(date +%s)" -ge "$until" ] && { say "driver still running (pid $pid); call watch again"; break; }
    sleep 5
  done
  collect
  echo "================ summary.md ================"
  cat "$OUT/summary.md" 2>/dev/null
}

case "$mode" in
  stash)
    [ -n "$K" ] || { say "stash needs the part number"; exit 2; }
    MAN=$(manifest)
    say "call $K of $(awk '$1 == "nparts" {print $2}' "$MAN"); bundle of commit $(awk '$1 == "commit" {print $2}' "$MAN")"
    [ "$K" -gt 1 ] && { check_parts 1 $((K - 1)) || exit 3; }
    stash_carried
    check_parts "$K" "$K" || exit 3
    [ "$K" = 1 ] && { nvidia-smi -L 2>&1 | head -4; df -h /root | tail -1; }
    say "part $K stashed; make the next call now"
    ;;
  start)
    MAN=$(manifest)
    N=$(awk '$1 == "nparts" {print $2}' "$MAN")
    say "last call ($N of $N); bundle of commit $(awk '$1 == "commit" {print $2}' "$MAN")"
    stash_carried
    check_parts 1 "$N" || exit 3
    read -r wname wsha _ < <(awk '$1 == "wheel" {print $2, $3, $4}' "$MAN")
    [ "$(sha256sum "$STASH/$wname" | cut -c1-64)" = "$wsha" ] || { say "wheel $wname missing or wrong"; exit 3; }
    say "wheel $wname: sha256 OK"
    if [ -f "$E2E_ROOT/driver.pid" ] && kill -0 "$(cat "$E2E_ROOT/driver.pid")" 2>/dev/null; then
      say "a driver is already running: watching it"; watch "$WATCH"; exit 0
    fi
    # assemble ---------------------------------------------------------------------------
    if [ ! -f "$E2E_ROOT/ASSEMBLED" ] || [ "$(cat "$E2E_ROOT/ASSEMBLED")" != "$(sha256sum "$MAN" | cut -c1-64)" ]; then
      rm -rf "$E2E_ROOT/site" "$E2E_ROOT/transport" "$E2E_ROOT/mooncake" "$E2E_ROOT/nixl" "$E2E_ROOT/sys"
      mkdir -p "$E2E_ROOT/mooncake" "$E2E_ROOT/nixl" "$E2E_ROOT/sys"
      say "assembling: parts -> payload -> site (xz -d), Mooncake, NIXL, debs"
      cat "$STASH"/part.* | tar -xf - -C "$E2E_ROOT" || { say "FAILED: unpacking the payload"; exit 4; }
      xz -dc -T0 "$E2E_ROOT/site.tar.xz" | tar -xf - -C "$E2E_ROOT" || { say "FAILED: unpacking site"; exit 4; }
      rm -f "$E2E_ROOT/site.tar.xz"
      "$PY" -m zipfile -e "$STASH/$wname" "$E2E_ROOT/site" || { say "FAILED: unpacking $wname"; exit 4; }
      tar -xJf "$E2E_ROOT"/transport/mooncake-*.tar.xz -C "$E2E_ROOT/mooncake" || say "FAILED: unpacking Mooncake"
      tar -xJf "$E2E_ROOT"/transport/nixl-*.tar.xz -C "$E2E_ROOT/nixl" || say "FAILED: unpacking NIXL"
      for deb in "$E2E_ROOT"/transport/debs/*.deb; do dpkg -x "$deb" "$E2E_ROOT/sys" || say "FAILED: dpkg -x $deb"; done
      sha256sum "$MAN" | cut -c1-64 >"$E2E_ROOT/ASSEMBLED"
      say "assembled: site $(du -sh "$E2E_ROOT/site" | cut -f1)"
    fi
    # vLLM's MooncakeConnector does `from mooncake.engine import TransferEngine`;
    # the bundle's slimmed mooncake/__init__.py imports mooncake.buffer_pool,
    # which the slimming dropped, so that import fails ("Mooncake is not
    # available"). The MC instances get a `mooncake` package of their own, first
    # on their PYTHONPATH (driver.py --mc-pythonpath, from E2E_MC_PYTHONPATH):
    # an empty __init__.py and the same engine.so and libraries (hard links),
    # its .libs folder beside it (engine.so's RPATH: $ORIGIN/../<dist>.libs).
    rm -rf "$E2E_ROOT/mcpy"; mkdir -p "$E2E_ROOT/mcpy/mooncake"
    for f in "$E2E_ROOT"/mooncake/mooncake/*.so; do
      [ -f "$f" ] && { ln -f "$f" "$E2E_ROOT/mcpy/mooncake/" 2>/dev/null || cp "$f" "$E2E_ROOT/mcpy/mooncake/"; }
    done
    : >"$E2E_ROOT/mcpy/mooncake/__init__.py"
    for d in "$E2E_ROOT"/mooncake/*.libs; do [ -d "$d" ] && ln -sfn "$d" "$E2E_ROOT/mcpy/"; done
    {
      echo "export PYTHONPATH=$E2E_ROOT/site:$E2E_ROOT/nixl"
      echo "export ORBITKV_MOONCAKE_LIB=$E2E_ROOT/mooncake/mooncake/engine.so"
      echo "export E2E_MC_PYTHONPATH=$E2E_ROOT/mcpy"
      LDP=
      for lib in libibverbs.so.1 libnuma.so.1 libmlx5.so.1; do
        ldconfig -p 2>/dev/null | grep -q "$lib" || LDP=$E2E_ROOT/sys/usr/lib/x86_64-linux-gnu
      done
      if ! ldconfig -p 2>/dev/null | grep -q 'libcudart.so.13'; then
        C=$("$PY" -c 'import glob,os,site
for sp in site.getsitepackages():
    h=glob.glob(os.path.join(sp,"nvidia","**","libcudart.so.13*"),recursive=True)
    if h: print(os.path.dirname(h[0])); break' 2>/dev/null)
        [ -n "$C" ] && LDP=${LDP:+$LDP:}$C
      fi
      [ -n "$LDP" ] && echo "export LD_LIBRARY_PATH=$LDP\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
      echo "export GLOG_minloglevel=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1"
      echo "unset PYTORCH_CUDA_ALLOC_CONF"
    } >"$E2E_ROOT/env.sh"
    # shellcheck disable=SC1091
    . "$E2E_ROOT/env.sh"
    cat "$E2E_ROOT/env.sh"
    mkdir -p "$E2E_ROOT/bin"
    cp benches/gpu/e2e/*.py "$E2E_ROOT/bin/"
    # the machine -----------------------------------------------------------------------
    {
      echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
      echo "host: $(hostname); kernel: $(uname -r); $(ldd --version 2>&1 | head -1); cpus: $(nproc)"
      echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
      cat "$STASH/BUILD_INFO" 2>/dev/null
      echo "--- nvidia-smi"; timeout 20 nvidia-smi 2>&1 | head -20
      echo "--- nvidia-smi topo -m"; timeout 20 nvidia-smi topo -m 2>&1 | head -8
      echo "--- RDMA devices"; ls /sys/class/infiniband 2>&1 | head -3
      echo "--- ldd engine.so"; ldd "$ORBITKV_MOONCAKE_LIB" 2>&1 | grep -E 'not found|libcudart|libibverbs|libnuma' || true
      echo "--- env"; env | grep -E '^(PYTHONPATH|LD_LIBRARY_PATH|ORBITKV_|MC_|UCX_|NIXL_|NCCL_|CUDA_VISIBLE|TORCH_|NVSHMEM_)' | sort
    } >"$E2E_ROOT/env.txt" 2>&1
    say "pre-flight imports"
    timeout 180 "$PY" - <<'EOF' 2>&1 | grep -v '^I[0-9]' | tail -12 | tee -a "$E2E_ROOT/env.txt"
import time; t = time.time()
import torch, transformers, vllm, orbitkv
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("vllm", vllm.__version__, vllm.__file__); print("transformers", transformers.__version__)
print("orbitkv", orbitkv.__version__, orbitkv.__file__)
import orbitkv.vllm.pd, orbitkv.proxy
try:
    import nixl._api; print("nixl", nixl.__file__)
except Exception as e: print("NIXL IMPORT FAILED:", type(e).__name__, e)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector  # noqa
print(f"imports {time.time() - t:.1f}s")
EOF
    say "pre-flight: vLLM's MooncakeConnector with E2E_MC_PYTHONPATH ($E2E_MC_PYTHONPATH)"
    PYTHONPATH=$E2E_MC_PYTHONPATH:$PYTHONPATH timeout 180 "$PY" - <<'EOF' 2>&1 | grep -v '^I[0-9]' | tail -6 | tee -a "$E2E_ROOT/env.txt"
import mooncake
from mooncake.engine import TransferEngine
print("mooncake for vLLM:", mooncake.__file__, TransferEngine)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as m
print("vLLM MooncakeConnector sees TransferEngine:", m.TransferEngine is not None)
EOF
    # start the driver in its own session ---------------------------------------------
    rm -rf "$E2E_ROOT/results" "$E2E_ROOT/work/logs" "$E2E_ROOT/work/bench"   # (the models are kept)
    mkdir -p "$E2E_ROOT/results" "$E2E_ROOT/work"
    cp "$E2E_ROOT/env.txt" "$E2E_ROOT/results/"
    # (the driver reads E2E_DRIVER_ARGS itself, split as a shell splits words)
    setsid nohup "$PY" "$E2E_ROOT/bin/driver.py" --device cuda --work "$E2E_ROOT/work" --out "$E2E_ROOT/results" \
      --deadline-s "$DEADLINE" >"$E2E_ROOT/driver.log" 2>&1 </dev/null &
    echo $! >"$E2E_ROOT/driver.pid"
    say "driver started (pid $(cat "$E2E_ROOT/driver.pid"), deadline ${DEADLINE}s); watching for ${WATCH}s"
    watch "$WATCH"
    ;;
  watch)
    [ -f "$E2E_ROOT/driver.pid" ] || { say "no driver was started on this machine (a fresh machine?)"; exit 3; }
    # shellcheck disable=SC1091
    . "$E2E_ROOT/env.sh"
    watch "$WATCH"
    ;;
  local)
    # CPU dry run of the driver here: .venv's vLLM (CPU) and orbitkv, no bundle, no NIXL
    E2E_ROOT=${E2E_ROOT_LOCAL:-/tmp/orbitkv-e2e-local}
    rm -rf "$E2E_ROOT/results"; mkdir -p "$E2E_ROOT/bin" "$E2E_ROOT/results"
    cp benches/gpu/e2e/*.py "$E2E_ROOT/bin/"
    PY=${E2E_PYTHON:-$ROOT/.venv/bin/python}
    "$PY" "$E2E_ROOT/bin/driver.py" --device cpu --python "$PY" --work "$E2E_ROOT/work" --out "$E2E_ROOT/results" \
      --deadline-s "$DEADLINE" --nixl-mock 2>&1 | tee "$E2E_ROOT/driver.log"
    echo $$ >"$E2E_ROOT/driver.pid"
    OUT=$E2E_ROOT/out; mkdir -p "$OUT"; collect
    ;;
  *)
    sed -n '2,30p' "$0"; exit 2 ;;
esac
