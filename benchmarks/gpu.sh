#!/usr/bin/env bash
# The GPU figures, in stages that each take less than 10 minutes on one H100 host with 16
# cores, run in the order below (docs/operations.md, "GPU check"):
#
#   bash benchmarks/gpu.sh STAGE [STAGE ...]       # figures in runs/gpu/ (RESULTS)
#
#   prepare         (the host that has the network, not the GPU one) wheels for an offline
#                   Python 3.12 GPU host in runs/carry/whl, the corpus built and packed in
#                   runs/carry/pysrc-pack: carry runs/carry (about 32 MB)
#   setup           carried wheels installed into /tmp/site-py3XX when imports fail, the
#                   corpus unpacked from its pack and checked (every invocation does this)
#   codecs          device codecs bit for bit on the GPU, what one chunk's copies,
#                   hashes and codecs cost (benchmarks/gpu/datapath_costs.py), 4 peers
#                   all-reducing 50M and 500M values against gloo float32 and ideal 1/10
#                   Gbit/s links
#   memory          peak GPU memory, host RSS and step time of one node, 150m and 1b; the
#                   CPU estimate beside it; projected minutes of the quality stages
#   memory-1b       one node of the 1b preset at a 32K vocabulary, 8 x 1024 tokens per inner
#                   step, checkpointed, micro-batches of 2, outer state in host RAM:
#                   torch.cuda.max_memory_allocated beside `dilonode memory`'s estimate
#                   (target <= 22 GB) in memory-1b.json
#   daemon-cost     benchmarks/loopback/daemon_cost.py --device cuda: tokens/s of a plain
#                   AdamW loop, `dilonode run` alone and 2 nodes (sharing the GPU), 150m,
#                   alternated 3 times (target: alone >= 98% of plain) in daemon-cost.json
#   quality-ddp, quality-diloco, quality-int4, quality-fp4
#                   the simulator, 4 workers x 2,000 steps of 150m with bf16 autocast on the
#                   corpus (benchmarks/gpu/quality.py); quality-table joins their reports
#   swarm-start     bootstrap + 4 `dilonode run` on the GPU for 11 minutes, detached, then
#                   waits up to SWARM_WAIT_S (480) s; swarm-collect waits for the end (up to
#                   540 s) and writes the figures: two commands, the second right after the first.
#   swarm           swarm-start and swarm-collect in one go (hosts without a time limit)
#   all             codecs memory memory-1b daemon-cost quality-ddp quality-diloco
#                   quality-int4 quality-fp4 swarm
#
# Env: PYTHON (default .venv/bin/python, else python3), RESULTS (runs/gpu), PACK_TO (after
# every stage, RESULTS is also packed there as gpu-results.tar.gz with summary.txt: a folder
# that comes back from a remote host), CORPUS (runs/corpus/pysrc), CORPUS_PACK (runs/carry/pysrc-pack),
# WHEELS (runs/carry/whl), SITE (/tmp/site-py3XX: where they are installed), SMOKE=1 (every
# stage at toy sizes on the CPU: the tests),
# QUALITY_ARGS (more gpu_quality.py arguments, e.g. "--batch-size 8": use the same for every
# method), QUALITY_MAX_S (540: a quality run projected to last longer stops at step 50),
# SWARM_MINUTES (11), SWARM_WAIT_S (480), SWARM_COLLECT_WAIT_S (540),
# ROUNDS_50M (3), ROUNDS_500M (2), CODEC_CHUNKS (the int4 chunk sweep at 50M: 262144 1048576
# 2097152 4194304 8388608 16777216) for codecs; their other rows take the daemon's chunk.
# Without a CUDA GPU a GPU stage says so and is skipped (exit 0), unless SMOKE=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
RESULTS=${RESULTS:-runs/gpu}
CORPUS=${CORPUS:-runs/corpus/pysrc}
CORPUS_PACK=${CORPUS_PACK:-runs/carry/pysrc-pack}
WHEELS=${WHEELS:-runs/carry/whl}
SMOKE=${SMOKE:-0}
SUMMARY="$RESULTS/summary.txt"
export PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"

# What an offline GPU host lacks (docs/operations.md, "GPU check"); name==version pinned to
# the versions CI runs. Sdist-only ones are built into wheels here.
BIN_WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 typing-extensions==4.16.0 blake3==1.0.11 cryptography==50.0.2
cffi==2.1.1 pycparser==3.12 hivemind==1.1.12 base58==2.1.1 py-multihash==3.0.0 mmh3==5.3.1
protobuf==7.36.2 netaddr==1.3.0 py-cid==0.5.0 py-multibase==2.0.0 six==1.17.0"
# hivemind's multiaddr codecs import netaddr and cid (py-cid and its needs) only when a
# DHT address is parsed: without them the bootstrap's DHT never comes up.
SDIST_WHEELS="varint==1.0.2 prefetch_generator==1.0.3 py-multicodec==1.0.0 morphys==1.0
python-baseconv==1.2.2"

log() { echo "$*" | tee -a "$SUMMARY"; }

has_cuda() { "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; }

need_gpu() {  # stage name: 0 when the stage should run here
  [ "$SMOKE" = 1 ] && return 0
  has_cuda && return 0
  log "## $1: skipped, torch sees no CUDA GPU (SMOKE=1 runs its CPU equivalent)"
  return 1
}

ensure_env() {
  # One folder per Python version: the carried wheels are built for one.
  local site
  site=${SITE:-/tmp/site-$("$PY" -c 'import sys; print("py%d%d" % sys.version_info[:2])')}
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  [ -d "$site" ] && export PYTHONPATH="$site:$PYTHONPATH"
  if ! "$PY" -c "import pydantic, blake3, cryptography, hivemind, netaddr, cid" 2>/dev/null; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$WHEELS"/*.whl
      export PYTHONPATH="$site:$PYTHONPATH"
    else
      echo "gpu.sh: dilonode's packages are missing and $WHEELS has no wheels" \
        "(bash benchmarks/gpu.sh prepare makes them on a host with the network)" >&2
    fi
  fi
  if [ "$SMOKE" != 1 ] && [ ! -f "$CORPUS/train.bin" ] && [ -f "$CORPUS_PACK/meta.json" ]; then
    "$PY" -m benchmarks.gpu.corpus unpack "$CORPUS_PACK" "$CORPUS" | tail -3
  fi
}

header() {
  log "# benchmarks/gpu.sh $*, $(date -u +%FT%TZ), commit $(git describe --always --dirty 2>/dev/null || echo '?')"
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
      || echo "no nvidia-smi"
    echo "cpus: $(nproc), load: $(cut -d' ' -f1-3 /proc/loadavg), memory: $(free -g | awk '/Mem:/ {print $2 " GiB"}')"
    "$PY" -c "import torch, platform; print('python', platform.python_version(), 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  } 2>&1 | tee -a "$SUMMARY"
}

live() {  # copy stdin to stdout and, with PACK_TO, to PACK_TO/$1 as it comes (a command
  # killed at its time limit still leaves what it printed there)
  if [ -n "${PACK_TO:-}" ]; then mkdir -p "$PACK_TO"; tee "$PACK_TO/$1"; else cat; fi
}

pack_results() {
  [ -n "${PACK_TO:-}" ] || return 0
  mkdir -p "$PACK_TO"
  tar czf "$PACK_TO/gpu-results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
  cp "$SUMMARY" "$PACK_TO/summary.txt"
}

# ------------------------------------------------------------------ stages

stage_prepare() {
  mkdir -p "$WHEELS"
  local plat="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: $plat -d "$WHEELS" $BIN_WHEELS
  # shellcheck disable=SC2086
  "$PY" -m pip wheel -q --no-deps -w "$WHEELS" $SDIST_WHEELS
  [ -f "$CORPUS/meta.json" ] || "$PY" -m benchmarks.gpu.corpus build "$CORPUS"
  if cmp -s "$CORPUS/meta.json" "$CORPUS_PACK/meta.json"; then
    log "corpus pack $CORPUS_PACK is up to date"
  else
    "$PY" -m benchmarks.gpu.corpus pack "$CORPUS" "$CORPUS_PACK" | tee -a "$SUMMARY"
  fi
  log "carry runs/carry: $(du -sh runs/carry | cut -f1)"
}

stage_setup() {
  "$PY" -c "import dilonode.sim.training, hivemind; print('dilonode and hivemind import')" \
    | tee -a "$SUMMARY"
  [ "$SMOKE" = 1 ] || "$PY" -m benchmarks.gpu.corpus verify "$CORPUS" | tee -a "$SUMMARY"
}

stage_codecs() {
  need_gpu codecs || return 0
  if [ "$SMOKE" = 1 ] && ! has_cuda; then
    log "## codecs: no CPU equivalent here (tests/unit/test_codec_paths.py is it)"
    return 0
  fi
  local out="$RESULTS/codecs"
  mkdir -p "$out"
  log "## codecs: device codecs and rounds on the GPU, bit for bit against the CPU"
  "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_codec_paths.py 2>&1 \
    | tail -3 | tee -a "$SUMMARY"
  "$PY" -m benchmarks.gpu.datapath_costs 2>&1 | tee "$out/costs.txt" | tee -a "$SUMMARY"
  bench cuda_50m --device cuda --numel 50000000 --codecs float32,int4 --rounds "${ROUNDS_50M:-3}"
  bench cpu_50m --device cpu --numel 50000000 --codecs int4,float32 --rounds "${ROUNDS_50M:-3}"
  bench cuda_500m --device cuda --numel 500000000 --codecs int4,float32 \
    --rounds "${ROUNDS_500M:-2}"
  # Every chunk costs kernel launches and host syncs on the GPU path; the daemon's default
  # (network.chunk_numel) comes from this sweep
  # (docs/reports/2026-11-28-gpu-allreduce-h200.md).
  local c
  for c in ${CODEC_CHUNKS:-262144 1048576 2097152 4194304 8388608 16777216}; do
    bench "cuda_50m_chunk$c" --device cuda --numel 50000000 --codecs int4 --rounds 5 \
      --chunk "$c"
  done
  "$PY" - "$out" <<'EOF' | tee -a "$SUMMARY"
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
}

bench() {  # name, then benchmarks/loopback/allreduce.py arguments
  local name=$1; shift
  log "## codecs $name: $*"
  "$PY" -m benchmarks.loopback.allreduce --procs 4 --reuse-output --link-gbit 1,10 \
    --json "$RESULTS/codecs/$name.json" "$@" 2>&1 | tee "$RESULTS/codecs/$name.txt" \
    | grep -v '^rank 0' | tee -a "$SUMMARY"
}

stage_memory() {
  need_gpu memory || return 0
  log "## memory: one node's GPU memory, host RAM and step time"
  if [ "$SMOKE" = 1 ]; then
    "$PY" -m benchmarks.gpu.memory estimate --presets nano --measure-outer nano \
      --json "$RESULTS/memory-estimate.json" --md "$RESULTS/memory-estimate.md" | tee -a "$SUMMARY"
    "$PY" -m benchmarks.gpu.memory node --device cpu --preset nano --data builtin \
      --batch-size 2 --seq-len 32 --steps 3 | tee "$RESULTS/memory.json" | tee -a "$SUMMARY"
    return 0
  fi
  "$PY" -m benchmarks.gpu.memory estimate --measure-outer 150m,1b \
    --json "$RESULTS/memory-estimate.json" --md "$RESULTS/memory-estimate.md" | tee -a "$SUMMARY"
  "$PY" -m benchmarks.gpu.memory gpu --data "$CORPUS" --json "$RESULTS/memory.json" \
    --md "$RESULTS/memory.md" 2>&1 | tee "$RESULTS/memory.log" | live memory.log
  cat "$RESULTS/memory.md" >> "$SUMMARY"
}

stage_memory_1b() {
  need_gpu memory-1b || return 0
  local args=(--preset 1b --vocab 32000 --batch-size 8 --seq-len 1024 --micro-batch 2
    --steps 6 --device cuda)
  [ "$SMOKE" = 1 ] && args=(--preset nano --vocab 512 --batch-size 4 --seq-len 32
    --micro-batch 2 --steps 3 --device cpu)
  log "## memory-1b: $PY -m benchmarks.gpu.memory node ${args[*]} --checkpointing"
  # Builtin data: the memory does not depend on the tokens; model.vocab_size pads to 32K.
  "$PY" -m benchmarks.gpu.memory node "${args[@]}" --checkpointing --data builtin \
    --estimate --json "$RESULTS/memory-1b.json" 2>&1 | tee "$RESULTS/memory-1b.log" \
    | live memory-1b.log >/dev/null
  "$PY" - "$RESULTS/memory-1b.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
est = r["estimate_device_bytes"] / 1e9
peak = r.get("gpu_peak_allocated_bytes")
if peak is None:
    print(f"{r['preset']} on {r['device']}: estimate {r['estimate_device_bytes']:,} bytes "
          "(no GPU peak on the CPU)")
else:
    verdict = "met" if peak <= 22e9 else "NOT met"
    print(f"{r['preset']}, vocabulary {r['vocab_size']}, {r['batch_size']} x {r['seq_len']} "
          f"tokens, micro-batches of {r['micro_batch_size']}, checkpointed: "
          f"max_memory_allocated {peak / 1e9:.2f} GB, reserved "
          f"{r['gpu_peak_reserved_bytes'] / 1e9:.2f} GB, estimate {est:.2f} GB "
          f"(measured / estimate {r['measured_over_estimate']:.3f}); host peak RSS "
          f"{r['host_peak_rss_bytes'] / 1e9:.1f} GB; target <= 22 GB {verdict}")
EOF
}

stage_daemon_cost() {
  need_gpu daemon-cost || return 0
  local args=(--device cuda --preset 150m --batch-size 8 --seq-len 512 --steps 200
    --sync-every 50 --repeats 3)
  [ "$SMOKE" = 1 ] && args=(--device cpu --preset nano --batch-size 2 --seq-len 32
    --steps 12 --sync-every 6 --repeats 1)
  log "## daemon-cost: $PY -m benchmarks.loopback.daemon_cost ${args[*]}"
  "$PY" -m benchmarks.loopback.daemon_cost "${args[@]}" --json "$RESULTS/daemon-cost.json" \
    --md "$RESULTS/daemon-cost.md" 2>&1 | tee "$RESULTS/daemon-cost.log" \
    | live daemon-cost.log >/dev/null
  cat "$RESULTS/daemon-cost.md" >> "$SUMMARY"
}

stage_quality() {  # method
  need_gpu "quality-$1" || return 0
  local args=(--data "$CORPUS" --max-s "${QUALITY_MAX_S:-540}")
  [ "$SMOKE" = 1 ] && args=(--device cpu --preset nano --data builtin --steps 4 --workers 2
    --sync-every 3 --fragments 3 --seq-len 32 --batch-size 2 --eval-every 2
    --eval-batches 1 --warmup 1)
  # shellcheck disable=SC2206
  args+=(${QUALITY_ARGS:-})
  log "## quality-$1: $PY -m benchmarks.gpu.quality run --method $1 ${args[*]}"
  rm -f "$RESULTS/quality-$1.json"
  "$PY" -m benchmarks.gpu.quality run --method "$1" --json "$RESULTS/quality-$1.json" \
    "${args[@]}" 2>&1 | tee "$RESULTS/quality-$1.log" | live "quality-$1.log"
  stage_quality_table
}

stage_quality_table() {
  "$PY" -m benchmarks.gpu.quality table "$RESULTS"/quality-*.json \
    | tee "$RESULTS/quality.md" | tee -a "$SUMMARY"
}

swarm_args() {
  if [ "$SMOKE" = 1 ]; then
    echo "--nodes 2 --preset nano --fragments 3 --data builtin --device cpu --minutes 0.2"
    echo "--step-seconds 0.05 --batch-size 4 --seq-len 64 --eval-every 200"
  else
    echo "--data $CORPUS --minutes ${SWARM_MINUTES:-11}"
  fi
}

stage_swarm_start() {
  need_gpu swarm || return 0
  local info
  # shellcheck disable=SC2046
  info=$("$PY" -m benchmarks.gpu.swarm start --dir "$RESULTS/swarm" $(swarm_args))
  log "## swarm-start: $info"
  "$PY" -m benchmarks.gpu.swarm wait --dir "$RESULTS/swarm" --max-s "${SWARM_WAIT_S:-480}" \
    | tee -a "$SUMMARY" || true
}

stage_swarm_collect() {
  need_gpu swarm || return 0
  if [ ! -f "$RESULTS/swarm/pids.json" ]; then
    log "## swarm-collect: no swarm was started on this machine (swarm-start first, and the" \
      "next device call within 30 s, before the machine goes back)"
    return 1
  fi
  "$PY" -m benchmarks.gpu.swarm wait --dir "$RESULTS/swarm" \
    --max-s "${SWARM_COLLECT_WAIT_S:-540}" | tee -a "$SUMMARY" || true
  log "## swarm: bootstrap + $(grep -o '"nodes": [0-9]*' "$RESULTS/swarm/pids.json")"
  "$PY" -m benchmarks.gpu.swarm collect --dir "$RESULTS/swarm" --json "$RESULTS/swarm.json" \
    --md "$RESULTS/swarm.md" | tee -a "$SUMMARY"
}

run_stage() {
  case "$1" in
    prepare) stage_prepare ;;
    setup) stage_setup ;;
    codecs) stage_codecs ;;
    memory) stage_memory ;;
    memory-1b) stage_memory_1b ;;
    daemon-cost) stage_daemon_cost ;;
    quality-ddp|quality-diloco|quality-int4|quality-fp4) stage_quality "${1#quality-}" ;;
    quality-table) stage_quality_table ;;
    swarm-start) stage_swarm_start ;;
    swarm-collect) stage_swarm_collect ;;
    swarm) stage_swarm_start && SWARM_COLLECT_WAIT_S=100000 stage_swarm_collect ;;
    *) echo "gpu.sh: unknown stage '$1' (see the top of benchmarks/gpu.sh)" >&2; return 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2; }
stages=()
for s in "$@"; do
  if [ "$s" = all ]; then
    stages+=(codecs memory memory-1b daemon-cost quality-ddp quality-diloco quality-int4
      quality-fp4 swarm)
  else
    stages+=("$s")
  fi
done
[ "${stages[0]}" = prepare ] || ensure_env
header "${stages[*]}"
failed=()
for s in "${stages[@]}"; do
  t0=$(date +%s)
  # Not as an `if` condition: there `set -e` would not stop a stage at its first error.
  set +e
  (set -e; run_stage "$s")
  rc=$?
  set -e
  if [ $rc -eq 0 ]; then
    log "-- $s: done in $(( $(date +%s) - t0 )) s"
  else
    failed+=("$s")
    log "-- $s: FAILED (exit $rc) after $(( $(date +%s) - t0 )) s"
  fi
  pack_results
done
echo "figures in $RESULTS${PACK_TO:+ (and packed into $PACK_TO)}"
[ ${#failed[@]} -eq 0 ] || { echo "failed stages: ${failed[*]}" >&2; exit 1; }
