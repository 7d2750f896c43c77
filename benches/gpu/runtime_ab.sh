#!/usr/bin/env bash
# The runtime dispatch benchmarks (benches/runtime.rs) of two builds, side by
# side on one quiet host (the GPU device machine's CPU: no GPU is used),
# alternating A B B A so that drift in the host's state falls on both:
#
#   benches/gpu/runtime_ab.sh A_BIN B_BIN [criterion filter]
#
# A_BIN and B_BIN are bench executables built HERE (`cargo bench --bench
# runtime --no-run` prints the path; the device has no cargo), carried in
# the device call. Each run prints the per-thread breakdown and criterion's
# estimates; everything goes to $OUT/runtime-ab/ (one file per run, and
# host.txt: CPU, load, kernel).
set -euo pipefail
A=$1
B=$2
FILTER=${3:-layer_ready_to_submit}
OUT=${OUT:-/tmp/out}
dir=$OUT/runtime-ab
mkdir -p "$dir"
{
  echo "date: $(date -u +%FT%TZ)"
  echo "kernel: $(uname -r)"
  echo "cpus: $(nproc)"
  grep -m1 "model name" /proc/cpuinfo || true
  echo "load: $(cat /proc/loadavg)"
  echo "A: $A ($(sha256sum "$A" | cut -c1-16))"
  echo "B: $B ($(sha256sum "$B" | cut -c1-16))"
} > "$dir/host.txt"
i=0
for which in A B B A; do
  i=$((i + 1))
  bin=$A
  [ "$which" = B ] && bin=$B
  echo "== run $i: $which ($bin) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$dir/host.txt"
  # criterion's own output dir is per run (nothing compares with a previous run)
  CRITERION_HOME=$(mktemp -d) "$bin" --bench --warm-up-time 1 --measurement-time 3 --noplot "$FILTER" \
    > "$dir/run$i-$which.txt" 2>&1 || echo "run $i exited $?" | tee -a "$dir/host.txt"
  grep -E "^layer_ready|time:|forward path|caller|thread" "$dir/run$i-$which.txt" | head -30
done
