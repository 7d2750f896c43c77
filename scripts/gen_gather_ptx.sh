#!/usr/bin/env bash
# Regenerates src/transport/shim/gather_kernel.ptx, the writer's gather
# kernel that the shim loads (cuModuleLoadData; the driver JIT-compiles it
# for the GPU it runs on), from its source gather_kernel.cu. A developer's
# tool, not run by the build or CI: it needs clang with the NVPTX back end
# (Debian: apt-get install clang-14). With PTXAS set to a ptxas binary it
# also assembles the result for sm_90 (a check that the driver's JIT will
# take it).
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG=${CLANG:-clang-14}
src=src/transport/shim/gather_kernel.cu
out=src/transport/shim/gather_kernel.ptx
{
  echo "// Generated from gather_kernel.cu by scripts/gen_gather_ptx.sh ($("$CLANG" --version | head -1)): do not edit."
  "$CLANG" -x cuda --cuda-device-only --cuda-gpu-arch=sm_70 -nocudainc -nocudalib -O3 -S "$src" -o -
} > "$out.tmp"
mv "$out.tmp" "$out"
if [ -n "${PTXAS:-}" ]; then
  "$PTXAS" -arch=sm_90 "$out" -o /dev/null
  echo "gen_gather_ptx: ptxas sm_90 took it"
fi
echo "gen_gather_ptx: wrote $out"
