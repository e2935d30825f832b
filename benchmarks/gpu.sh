#!/usr/bin/env bash
# The GPU figures of issue 16 section 1, in one script (< 10 minutes on one H100 host with
# 16 cores): the device codecs bit for bit on the GPU, then 4 peers on loopback all-reducing
# fragments of 50M and 500M values with the pseudo-gradient on the GPU (codecs and reduction
# there: the round's torch data path) against torch.distributed gloo float32 on the same
# values in the same run, and against an ideal 1 and 10 Gbit/s link.
#
#   make setup && bash benchmarks/gpu.sh            # figures in runs/gpu/<UTC time>/
#   PYTHON=python3 bash benchmarks/gpu.sh           # an interpreter that has CUDA torch
#
# Offline GPU hosts: install the missing packages from wheels first, as docs/operations.md
# ("GPU check") describes (numba and llvmlite are optional here: the GPU path does not use
# them). Env: PYTHON, OUT (folder), ROUNDS_50M (3), ROUNDS_500M (2), CHUNK_500M (1048576
# values per frame; the daemon's default 262144 is used at 50M).
# Target: int4 round wall <= gloo float32 wall for the same tensor (summary.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-runs/gpu/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"

"$PY" - <<'EOF'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("benchmarks/gpu.sh: torch sees no CUDA GPU")
EOF

{
  echo "# benchmarks/gpu.sh, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  echo "cpus: $(nproc), load: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$PY" -c "import torch, platform; print('python', platform.python_version(), 'torch', torch.__version__)"
} | tee "$SUMMARY"

echo "## device codecs and rounds on the GPU, bit for bit against the CPU" | tee -a "$SUMMARY"
"$PY" -m pytest -q -p no:cacheprovider tests/unit/test_codec_paths.py 2>&1 \
  | tail -3 | tee -a "$SUMMARY"

bench() {  # name, then benchmarks/allreduce.py arguments
  local name=$1; shift
  echo "## $name: $*" | tee -a "$SUMMARY"
  "$PY" benchmarks/allreduce.py --procs 4 --reuse-output --link-gbit 1,10 \
    --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.txt" \
    | grep -v '^rank 0' | tee -a "$SUMMARY"
}

bench cuda_50m --device cuda --numel 50000000 --codecs float32,int4 --rounds "${ROUNDS_50M:-3}"
bench cpu_50m --device cpu --numel 50000000 --codecs int4 --rounds "${ROUNDS_50M:-3}"
bench cuda_500m --device cuda --numel 500000000 --codecs int4,float32 \
  --rounds "${ROUNDS_500M:-2}" --chunk "${CHUNK_500M:-1048576}"

"$PY" - "$OUT" <<'EOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    rows = {(r["method"], r["codec"]): r for r in json.loads(f.read_text())["results"]}
    gloo, int4 = rows.get(("gloo", "float32")), rows.get(("dilonode", "int4"))
    if gloo and int4:
        ratio = int4["wall_median_s"] / gloo["wall_median_s"]
        verdict = "met" if ratio <= 1 else "not met"
        print(f"{f.stem}: int4 {int4['wall_median_s']:.3f} s vs gloo float32 "
              f"{gloo['wall_median_s']:.3f} s per round = {ratio:.2f}x: target {verdict}")
EOF
echo "figures in $OUT"
