#!/usr/bin/env bash
# Coverage-guided fuzzing of the wire contract (fuzz/fuzz_targets/wire.rs):
# libFuzzer through libfuzzer-sys, built on stable Rust with LLVM's
# SanitizerCoverage (the flags cargo-fuzz passes, minus the nightly-only
# sanitizer). Runs for ORBITKV_FUZZ_SECONDS (default 30) from the committed
# seed corpus; new inputs go to a scratch folder, a crash to fuzz/artifacts/.
#   ./scripts/fuzz.sh            # what CI runs
#   ORBITKV_FUZZ_SECONDS=600 ./scripts/fuzz.sh
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
SECONDS_TO_RUN=${ORBITKV_FUZZ_SECONDS:-30}
TARGET=x86_64-unknown-linux-gnu  # explicit, so RUSTFLAGS skip build scripts
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
cargo build --quiet --release --target "$TARGET" --bin wire
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p artifacts
log="$work/log"
rc=0
"./target/$TARGET/release/wire" "$work" corpus/wire -max_total_time="$SECONDS_TO_RUN" -max_len=65536 \
  -artifact_prefix=artifacts/ -print_final_stats=1 >"$log" 2>&1 || rc=$?
grep -E "^(Done|stat::number_of_executed_units|#[0-9]+.*DONE)" "$log" || true
if [ "$rc" -ne 0 ]; then
  tail -40 "$log"
  echo "fuzz: the wire target failed (rc $rc); the input is in fuzz/artifacts/" >&2
  exit "$rc"
fi
runs=$(grep -oE "^Done [0-9]+ runs" "$log" | grep -oE "[0-9]+")
echo "fuzz: wire: ${runs:-?} inputs in ${SECONDS_TO_RUN}s, no crash"
