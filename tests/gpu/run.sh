#!/usr/bin/env bash
# The GPU lane (tests/gpu/lane.py's docstring says what each part checks):
#
#   bash tests/gpu/run.sh LOGDIR             # one CUDA GPU: every part, logs in LOGDIR, a table; exit 1 on a failure
#   bash tests/gpu/run.sh LOGDIR --dry-run   # no GPU needed: imports, carried wheels, paths, command lines
#
# Without a CUDA device (and without --dry-run) it prints one line and exits 0. LOGDIR gets parts.log (every part's
# log, one after another) and summary.txt (the device tool brings back 8 files at most from $OUT); the runs' own output (TensorBoard
# events, installed packages) goes to GPU_LANE_WORK (default: a fresh folder under /tmp). The parts share a time
# budget, GPU_LANE_BUDGET seconds (default 480: the lane's 8 minutes, inside the device tool's 10 per command); a part
# that finds too little of it left is reported as not run. GPU_LANE_PARTS (names, space-separated): run only
# those parts (setup always). PYTHON: the interpreter (default: .venv/bin/python where the checkout has one,
# else python3, the GPU machine's).
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

if [ "$dry" = 1 ]; then
  "$PYTHON" tests/gpu/lane.py dry-run 2>&1 | tee "$logdir/dry_run.log"
  exit "${PIPESTATUS[0]}"
fi
# Neither an NVIDIA device node nor nvidia-smi: no CUDA, known without importing torch (seconds on a loaded
# CPU host); otherwise torch decides.
if ! { compgen -G "/dev/nvidia*" >/dev/null || command -v nvidia-smi >/dev/null; } \
   || ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "gpu lane: skipped (no CUDA device here)"
  exit 0
fi

work=${GPU_LANE_WORK:-$(mktemp -d /tmp/megarl-gpu-lane.XXXXXX)}
mkdir -p "$work/site"
export PYTHONPATH="$PYTHONPATH:$work/site"  # the carried packages setup installs
budget=${GPU_LANE_BUDGET:-480}
# part:limit in seconds, in the order they run (setup first: the others need its packages)
parts="setup:120 kernels:180 offload:120 train_bf16:150 train_fp16:150 train_lora:120 reward_model:90 bench:120 sleep_level2:150"
start=$SECONDS failed=0 table="" setup_ok=1
echo "gpu lane: logs in $logdir, work in $work, budget ${budget}s"
: >"$logdir/parts.log"
for entry in $parts; do
  name=${entry%%:*} limit=${entry##*:}
  # GPU_LANE_PARTS="kernels bench": only those (and setup), e.g. to rerun what failed in the device time left.
  if [ -n "${GPU_LANE_PARTS:-}" ] && [ "$name" != setup ] && [[ " $GPU_LANE_PARTS " != *" $name "* ]]; then
    continue
  fi
  left=$((budget - (SECONDS - start)))
  [ "$limit" -le "$left" ] || limit=$left
  began=$SECONDS
  if [ "$setup_ok" = 0 ]; then
    result="FAIL" detail="not run: setup failed (parts.log)"
  elif [ "$limit" -lt 20 ]; then
    result="FAIL" detail="not run: the lane's ${budget}s budget is spent"
  else
    timeout -k 10 "$limit" "$PYTHON" tests/gpu/lane.py part "$name" --work "$work" >"$work/$name.log" 2>&1
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
  [ "$name" != setup ] || [ "$result" = PASS ] || setup_ok=0
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
