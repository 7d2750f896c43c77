#!/usr/bin/env bash
# GPU qualification of OrbitKV, run ON the GPU machine from the repository
# root, with the bundle that benches/gpu/prepare.sh built here carried along:
#
#   device call:  bash benches/gpu/run.sh        carry: [".gpu"]
#
# Unpacks .gpu into /tmp, checks the machine, and runs benches/gpu/qualify.py
# once per configuration (each in its own processes, each under a time limit;
# a configuration that fails or runs out of time is recorded and the next one
# runs). Writes into $OUT (default ./bench-results/gpu): run.log, env.txt,
# results.json, results.md. The whole run stays under ORBITKV_QUALIFY_TOTAL_S
# (default 480 s).
#
# Configurations, in order (first the ones the qualification rests on):
#   two GPUs: Mooncake NVLink 0->1, NIXL 0->1, torch 0->1, Mooncake TCP 0->1,
#             then the same across two processes on GPU 0 (0->0)
#   one GPU:  the 0->0 ones
# For a test on a machine without a GPU: ORBITKV_QUALIFY_DEVICE=cpu (small
# sizes, CPU tensors, TCP), ORBITKV_QUALIFY_PYTHON=.venv/bin/python, and
# ORBITKV_QUALIFY_BUNDLE=0 to use the interpreter's installed packages.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
T0=$(date +%s)
TOTAL=${ORBITKV_QUALIFY_TOTAL_S:-480}
OUT=${OUT:-$ROOT/bench-results/gpu}
PY=${ORBITKV_QUALIFY_PYTHON:-python3}
DEVICE=${ORBITKV_QUALIFY_DEVICE:-cuda}
BUNDLE=${ORBITKV_QUALIFY_BUNDLE:-1}
W=${ORBITKV_QUALIFY_WORK:-/tmp/orbitkv-qualify}
mkdir -p "$OUT"
rm -rf "$W"
mkdir -p "$W/results"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 GLOG_minloglevel=${GLOG_minloglevel:-1}

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL - $(elapsed) )); }
say() { echo "[run.sh $(date -u +%H:%M:%S) +$(elapsed)s] $*"; }

say "OrbitKV GPU qualification: device=$DEVICE bundle=$BUNDLE python=$PY out=$OUT budget=${TOTAL}s"
# CUDA IPC (Mooncake's NVLink transport) shares whole cudaMalloc allocations;
# expandable segments would put the KV tensors inside VMM mappings
if [ -n "${PYTORCH_CUDA_ALLOC_CONF:-}" ]; then
  say "unsetting PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF"
  unset PYTORCH_CUDA_ALLOC_CONF
fi

# 1. unpack the bundle ---------------------------------------------------------------
if [ "$BUNDLE" = 1 ]; then
  if [ ! -d .gpu ]; then
    say "no .gpu here: run benches/gpu/prepare.sh on the build machine and carry [\".gpu\"]"
    exit 2
  fi
  cat .gpu/BUILD_INFO 2>/dev/null
  mkdir -p "$W/site" "$W/mooncake" "$W/nixl" "$W/sys"
  "$PY" -m zipfile -e .gpu/orbitkv-*.whl "$W/site" || say "FAILED: unpacking the orbitkv wheel"
  tar -xJf .gpu/mooncake-cuda13-*.tar.xz -C "$W/mooncake" || say "FAILED: unpacking Mooncake"
  tar -xJf .gpu/nixl-cu13-*.tar.xz -C "$W/nixl" || say "FAILED: unpacking NIXL"
  for deb in .gpu/debs/*.deb; do
    dpkg -x "$deb" "$W/sys" || say "FAILED: dpkg -x $deb"
  done
  export PYTHONPATH="$W/site:$W/nixl${PYTHONPATH:+:$PYTHONPATH}"
  export ORBITKV_MOONCAKE_LIB="$W/mooncake/mooncake/engine.so"
  # Debian's libibverbs/libnuma/libmlx5 only where the machine lacks them
  for lib in libibverbs.so.1 libnuma.so.1 libmlx5.so.1; do
    if ! ldconfig -p 2>/dev/null | grep -q "$lib"; then
      export LD_LIBRARY_PATH="$W/sys/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      say "using the carried $lib (and its siblings) from $W/sys"
      break
    fi
  done
  # engine.so needs libcudart.so.13: take the one of torch's nvidia wheels if the loader has none
  if ! ldconfig -p 2>/dev/null | grep -q 'libcudart.so.13'; then
    CUDART_DIR=$("$PY" - <<'EOF' 2>/dev/null
import glob, os, site
for sp in site.getsitepackages():
    hits = glob.glob(os.path.join(sp, "nvidia", "**", "libcudart.so.13*"), recursive=True)
    if hits:
        print(os.path.dirname(hits[0]))
        break
EOF
)
    if [ -n "$CUDART_DIR" ]; then
      export LD_LIBRARY_PATH="$CUDART_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      say "libcudart.so.13 from $CUDART_DIR"
    fi
  fi
fi

# 2. the machine ------------------------------------------------------------------------------
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "host: $(hostname); kernel: $(uname -r); $(ldd --version 2>&1 | head -1)"
  echo "cpus: $(nproc); memory: $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB (MemTotal grows with use on these VMs)"}')"
  echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  "$PY" - <<'EOF' 2>&1
import torch
print("torch:", torch.__version__, "CUDA", torch.version.cuda, "devices:", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
if torch.cuda.device_count() > 1:
    print("  peer access 0->1:", torch.cuda.can_device_access_peer(0, 1))
EOF
  echo "--- nvidia-smi"
  timeout 20 nvidia-smi 2>&1 | head -25
  echo "--- nvidia-smi topo -m"
  timeout 20 nvidia-smi topo -m 2>&1 | head -12
  echo "--- nvidia-smi nvlink -s (GPU 0)"
  timeout 20 nvidia-smi nvlink -s -i 0 2>&1 | head -20
  echo "--- RDMA devices"
  ls /sys/class/infiniband 2>&1 | head -5
  if [ "$BUNDLE" = 1 ]; then
    echo "--- ldd engine.so (the libraries it gets from the system)"
    ldd "$ORBITKV_MOONCAKE_LIB" 2>&1 | grep -E 'not found|libcudart|libibverbs|libmlx5|libnuma|libcurl' || true
  fi
  echo "--- env"
  env | grep -E '^(PYTHONPATH|LD_LIBRARY_PATH|ORBITKV_|MC_|UCX_|NIXL_|NCCL_NVLS|CUDA_VISIBLE|PYTORCH_CUDA)' | sort
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

NGPU=0
if [ "$DEVICE" = cuda ]; then
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [ "$NGPU" -lt 1 ]; then
    say "no GPU visible to torch: nothing to qualify"
  fi
fi

# 3. pre-flight: can this Python load orbitkv, Mooncake and NIXL? --------------------------------
say "pre-flight"
timeout 60 "$PY" - <<'EOF' 2>&1 | grep -v '^I[0-9]' | tail -8
import os, torch
if torch.cuda.is_available():
    torch.cuda.init()
import orbitkv
print("orbitkv", orbitkv.__version__, "from", os.path.dirname(orbitkv.__file__))
try:
    with orbitkv.MooncakeTransferEngine() as e:
        print("mooncake", e.mooncake_version, e.mooncake_library, "endpoint", e.endpoint)
except Exception as ex:
    print("MOONCAKE PRE-FLIGHT FAILED:", type(ex).__name__, ex)
try:
    import nixl
    from nixl._api import nixl_agent, nixl_agent_config
    a = nixl_agent("preflight", nixl_agent_config(backends=["UCX"]))
    print("nixl plugins", a.get_plugin_list(), "backends", list(a.backends))
except Exception as ex:
    print("NIXL PRE-FLIGHT FAILED:", type(ex).__name__, ex)
EOF

# 4. the configurations ----------------------------------------------------------------------
COMMON=()
if [ "$DEVICE" = cpu ]; then
  COMMON=(--device cpu --tokens 1024,8192 --layers 4 --raw-mib 64 --raw-reps 3 --kv-reps 2)
  CONFIGS=("mooncake tcp x x 60" "nixl - x x 60" "torch - x x 30")
elif [ "$NGPU" -ge 2 ]; then
  CONFIGS=("mooncake nvlink 0 1 90" "nixl - 0 1 75" "torch - 0 1 40" "mooncake tcp 0 1 110"
           "mooncake nvlink 0 0 80" "nixl - 0 0 60" "torch - 0 0 30" "mooncake tcp 0 0 100")
elif [ "$NGPU" -eq 1 ]; then
  CONFIGS=("mooncake nvlink 0 0 90" "nixl - 0 0 75" "torch - 0 0 40" "mooncake tcp 0 0 110")
else
  CONFIGS=()
fi

# ORBITKV_QUALIFY_CONFIGS: ";"-separated configurations instead of the list
# above, each "suite transport src dst budget [qualify.py run options...]"
# (an A/B of a runtime knob: "mooncake nvlink 0 1 90 --max-ranges-in-flight 768;
# mooncake nvlink 0 1 90 --max-ranges-in-flight 65536").
if [ -n "${ORBITKV_QUALIFY_CONFIGS:-}" ]; then
  IFS=';' read -r -a CONFIGS <<<"$ORBITKV_QUALIFY_CONFIGS"
fi

n=0
for cfg in "${CONFIGS[@]}"; do
  read -r suite transport src dst budget extra <<<"$cfg"
  n=$((n + 1))
  rem=$(left)
  if [ "$rem" -lt 40 ]; then
    say "SKIPPED $suite $transport $src->$dst: ${rem}s left of ${TOTAL}s"
    continue
  fi
  [ "$budget" -gt $((rem - 30)) ] && budget=$((rem - 30))
  tag=$(printf '%02d-%s-%s-%s%s' "$n" "$suite" "${transport/-/x}" "$src" "$dst")
  args=(run --suite "$suite" --budget-s "$budget" --out "$W/results/$tag.json" "${COMMON[@]}")
  [ "$transport" != - ] && args+=(--transport "$transport")
  [ "$src" != x ] && args+=(--src-gpu "$src" --dst-gpu "$dst")
  # shellcheck disable=SC2206 # the extra options are words on purpose
  [ -n "${extra:-}" ] && args+=($extra)
  say "config $tag (budget ${budget}s, hard limit $((budget + 25))s)"
  timeout -k 10 $((budget + 25)) "$PY" benches/gpu/qualify.py "${args[@]}"
  rc=$?
  [ "$rc" -ne 0 ] && say "config $tag exited with $rc$([ "$rc" -eq 124 ] && echo ' (killed at its time limit)')"
  if [ ! -s "$W/results/$tag.json" ]; then
    printf '{"suite": "%s", "transport": "%s", "status": "no result (exit %s)", "steps": {}}\n' \
      "$suite" "$transport" "$rc" >"$W/results/$tag.json"
  fi
done

# 5. report -------------------------------------------------------------------------------------
"$PY" - "$W/meta.json" <<EOF
import json, sys
meta = {"machine": open("$OUT/env.txt").read().split("--- nvidia-smi")[0].strip().replace("\n", "; "),
        "bundle": open(".gpu/BUILD_INFO").read().split("files:")[0].strip().replace("\n", "; ") if $BUNDLE else "installed packages",
        "total_s": $(elapsed)}
json.dump(meta, open(sys.argv[1], "w"))
EOF
say "report"
"$PY" benches/gpu/qualify.py report --dir "$W/results" --meta "$W/meta.json" \
  --out-json "$OUT/results.json" --out-md "$OUT/results.md" >/dev/null || say "FAILED: report"
# qualify.py --trace writes a trace per process into $OUT/traces: one archive
# (the device tool brings back at most 8 files)
if [ -d "$OUT/traces" ]; then
  tar -cJf "$OUT/traces.tar.xz" -C "$OUT" traces && rm -rf "$OUT/traces" || say "FAILED: packing the traces"
fi
say "done in $(elapsed)s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo "================ results.md ================"
cat "$OUT/results.md" 2>/dev/null
