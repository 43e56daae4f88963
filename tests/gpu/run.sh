#!/usr/bin/env bash
# The GPU lane (tests/gpu/lane.py's docstring says what each part checks):
#
#   bash tests/gpu/fetch.sh                  # here first: what must travel, into gpu_carry/ (the device tool's carry)
#   bash tests/gpu/run.sh LOGDIR             # one CUDA GPU: every part, logs in LOGDIR, a table; exit 1 on a failure
#   bash tests/gpu/run.sh LOGDIR --dry-run   # no GPU needed: what travels, limits, imports, paths, command lines
#
# Without a CUDA device (and without --dry-run) it prints one line and exits 0. LOGDIR gets parts.log (every part's
# log, one after another) and summary.txt, the table it also prints (the device tool brings back 8 files at most from
# $OUT); the runs' own output (TensorBoard events, installed packages, compile caches) goes to GPU_LANE_WORK
# (default: a fresh folder under /tmp). The parts and their limits are lane.py's (`lane.py plan`); they share a time
# budget, GPU_LANE_BUDGET seconds (default lane.py's BUDGET, 480: the lane's 8 minutes, inside the device tool's 10
# per command); a part that finds too little of it left, or whose prerequisite (setup, nccl) did not pass, is
# reported as not run. GPU_LANE_PARTS (names, space-separated): run only those parts (and what they need).
# PYTHON: the interpreter (default: .venv/bin/python where the checkout has one, else python3, the GPU machine's).
# GPU_LANE_REHEARSE=1 (the dry run's): no CUDA needed, every part passes without running anything.
set -uo pipefail

usage="usage: bash tests/gpu/run.sh LOGDIR [--dry-run]"
logdir="" dry=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) [ -z "$logdir" ] || { echo "$usage" >&2; exit 2; }; logdir=$arg ;;
  esac
done
[ -n "$logdir" ] || { echo "$usage" >&2; exit 2; }
mkdir -p "$logdir" && logdir=$(cd "$logdir" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# No network on the GPU machine: the Hugging Face libraries read local paths only, at once, instead of retrying.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [ "$dry" = 1 ]; then
  "$PYTHON" tests/gpu/lane.py dry-run 2>&1 | tee "$logdir/dry_run.log"
  exit "${PIPESTATUS[0]}"
fi
rehearse=()
if [ "${GPU_LANE_REHEARSE:-}" = 1 ]; then
  rehearse=(--rehearse)
# Neither an NVIDIA device node nor nvidia-smi: no CUDA, known without importing torch (seconds on a loaded
# CPU host); otherwise torch decides.
elif ! { compgen -G "/dev/nvidia*" >/dev/null || command -v nvidia-smi >/dev/null; } \
   || ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "gpu lane: skipped (no CUDA device here)"
  exit 0
fi

# "BUDGET NAME:LIMIT:NEEDS ...", in the order the parts run (GPU_LANE_PARTS="kernels bench": only those and
# what they need, e.g. to rerun what failed in the device time left)
plan=$("$PYTHON" tests/gpu/lane.py plan) || exit 2
read -r budget parts <<<"$plan"
work=${GPU_LANE_WORK:-$(mktemp -d /tmp/megarl-gpu-lane.XXXXXX)}
mkdir -p "$work/site"
export PYTHONPATH="$PYTHONPATH:$work/site"  # the carried packages setup installs
# One compile cache for every part: Megatron's fused SwiGLU and bias-dropout (torch.compile, megatron/core/jit.py)
# are compiled from cold once, by the first training run, and the later runs load them (Inductor's FX-graph and
# AOT-autograd caches); Triton's kernels likewise (kernels compiles what bench runs).
export TORCHINDUCTOR_CACHE_DIR="$work/compile_cache" TRITON_CACHE_DIR="$work/compile_cache/triton"
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
start=$SECONDS failed=0 table="" passed=" "
echo "gpu lane: logs in $logdir, work in $work, budget ${budget}s"
: >"$logdir/parts.log"
for entry in $parts; do
  IFS=: read -r name limit need <<<"$entry"
  left=$((budget - (SECONDS - start)))
  [ "$limit" -le "$left" ] || limit=$left
  began=$SECONDS
  if [ "$need" != - ] && [[ "$passed" != *" $need "* ]]; then
    result="FAIL" detail="not run: $need did not pass (parts.log)"
  elif [ "$limit" -lt 10 ]; then
    result="FAIL" detail="not run: the lane's ${budget}s budget is spent"
  else
    timeout -k 10 "$limit" "$PYTHON" tests/gpu/lane.py part "$name" --work "$work" "${rehearse[@]}" \
      >"$work/$name.log" 2>&1
    rc=$?
    verdict=$(grep -E '^(PASS|FAIL|SKIP)( |$)' "$work/$name.log" | tail -n 1)
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      result="FAIL" detail="timed out after ${limit}s (parts.log)"
    elif [ "$rc" = 0 ] && [ "${verdict%% *}" = PASS ]; then
      result="PASS" detail=${verdict#PASS }
    elif [ "$rc" = 0 ] && [ "${verdict%% *}" = SKIP ]; then  # what the part needs is not on this machine
      result="SKIP" detail=${verdict#SKIP }
    else
      result="FAIL" detail="exit $rc: ${verdict#FAIL }"
      [ -n "$verdict" ] || detail="exit $rc, no verdict line (parts.log: $(tail -n 1 "$work/$name.log" | cut -c1-160))"
    fi
    # every part's log in one file (the device tool brings back 8 files at most), written as each ends
    { echo "===== $name: $result"; cat "$work/$name.log"; } >>"$logdir/parts.log"
  fi
  [ "$result" = PASS ] || [ "$result" = SKIP ] || failed=$((failed + 1))
  [ "$result" != PASS ] || passed+="$name "
  line=$(printf '%-13s %-4s %5ss  %s' "$name" "$result" "$((SECONDS - began))" "$detail")
  echo "$line"
  table+="$line"$'\n'
done
{
  echo "gpu lane on $(hostname): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
  printf '%-13s %-4s %6s  %s\n' part result time detail
  printf '%s' "$table"
  echo "total $((SECONDS - start))s, $failed failed"
} | tee "$logdir/summary.txt"
[ "$failed" = 0 ]
