#!/usr/bin/env bash
# megarl as a SLURM batch job, resumable across preemption and time limits.
#
#   CONFIG=my.yaml sbatch --nodes 4 run_slurm.sh [train.py flags]      # from the checkout
#   CONFIG=my.yaml NODES=4 bash run_slurm.sh [train.py flags]          # the same: submits itself
#   CONFIG=examples/qwen7b_2x8.yaml NODES=2 bash run_slurm.sh           # Qwen2.5-7B-class GRPO on 2 x 8 GPUs
#
# Check a config's layout and memory for the job's shape first (starts nothing):
#   python tools/check_layout.py --config my.yaml --nodes 4 --gpus-per-node 8
#
# Settings (environment; sbatch passes the submitting shell's environment on):
#   CONFIG          YAML config for megarl/train.py (required)
#   NODES           nodes, when this script submits itself (default 2; or sbatch --nodes)
#   GPUS_PER_NODE   GPUs, and so ranks, per node (default 8)
#   LAUNCHER        torchrun: one torchrun agent per node, c10d rendezvous on the first node (default)
#                   srun:     one task per GPU, no torchrun (megarl reads SLURM_PROCID etc.)
#   EXTRA_ARGS      more train.py flags (split at spaces), before this script's own arguments
#   SAVE_DIR        checkpoints, kept across requeues (default runs/<config name>/checkpoints)
#   CONTAINER       image for pyxis/enroot (srun --container-image), e.g. a .sqsh file; unset: host env
#   CONTAINER_MOUNTS  extra pyxis mounts, src:dst[,src:dst] (the checkout is always mounted at its own path)
#   PYTHON          interpreter (default: python in a container, else .venv/bin/python, else python3)
#   RDZV_PORT       torchrun rendezvous port on the first node (default 29500)
#   MAX_REQUEUES    self-requeues after time limits before giving up (default 20)
# Partition, account, QOS, time: sbatch's own flags or SBATCH_PARTITION / SBATCH_ACCOUNT /
# SBATCH_QOS / SBATCH_TIMELIMIT, which win over the header below.
#
# Preemption and time limits: 120 s before the time limit SLURM sends SIGUSR1 to
# every task (--signal); at preemption it sends SIGTERM. train.py saves a
# checkpoint on either and exits; `--resume auto` continues from the newest one
# in SAVE_DIR. SLURM itself requeues preempted jobs and jobs on failed nodes
# (--requeue); after a time limit this script requeues the job.
#
#SBATCH --job-name=megarl
#SBATCH --nodes=2
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=USR1@120
#SBATCH --open-mode=append
#SBATCH --output=megarl-%x-%j.out

set -euo pipefail

NODES="${NODES:-2}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
LAUNCHER="${LAUNCHER:-torchrun}"
SIGNAL_SECONDS=120  # keep in step with --signal above

if [ -z "${CONFIG:-}" ]; then
  echo "run_slurm.sh: error: set CONFIG to a YAML config, e.g. CONFIG=examples/grpo.yaml" >&2
  exit 2
fi
case "$LAUNCHER" in torchrun | srun) ;; *)
  echo "run_slurm.sh: error: LAUNCHER must be torchrun or srun, got '$LAUNCHER'" >&2
  exit 2
  ;;
esac

# Outside a job: submit this script with the requested shape (flags on the command line
# win over the #SBATCH header) and the current environment.
if [ -z "${SLURM_JOB_ID:-}" ]; then
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  exec sbatch --nodes "$NODES" --gpus-per-node "$GPUS_PER_NODE" --ntasks-per-node "$GPUS_PER_NODE" \
    --chdir "$here" "$here/$(basename "${BASH_SOURCE[0]}")" "$@"
fi

# sbatch runs a copy of this script from its spool directory, in the directory it was
# submitted from (or --chdir): that must be the checkout.
if [ ! -f megarl/train.py ]; then
  echo "run_slurm.sh: error: submit from the megarl checkout (no megarl/train.py in $PWD)" >&2
  exit 2
fi
config_name="$(basename "${CONFIG%.*}")"
SAVE_DIR="${SAVE_DIR:-runs/$config_name/checkpoints}"
read -r -a extra <<<"${EXTRA_ARGS:-}"
train=(megarl/train.py --config "$CONFIG" --save-dir "$SAVE_DIR" --resume auto "${extra[@]}" "$@")

srun_flags=(--nodes "$SLURM_NNODES" --kill-on-bad-exit=1)
if [ -n "${CONTAINER:-}" ]; then
  mounts="$PWD:$PWD${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
  srun_flags+=(--container-image "$CONTAINER" --container-mounts "$mounts" --container-workdir "$PWD")
  PYTHON="${PYTHON:-python}"
elif [ -x .venv/bin/python ]; then
  PYTHON="${PYTHON:-$PWD/.venv/bin/python}"
else
  PYTHON="${PYTHON:-python3}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cpus="${SLURM_CPUS_ON_NODE:-$(nproc)}"

if [ "$LAUNCHER" = torchrun ]; then
  # sed reads to the end: `head -n 1` could end the pipe early, and SIGPIPE fails it under pipefail.
  head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
  # One agent per node with all the node's CPUs (a step's task gets 1 CPU unless told).
  srun_flags+=(--ntasks-per-node 1 --cpus-per-task "$cpus")
  # The agent must outlive SIGUSR1, whose default action ends a process: an agent that
  # dies ends the step, and SLURM then kills the ranks while they save. Ignoring it in the
  # agent is enough; train.py installs its own handler. (SIGTERM is the agent's to handle:
  # it passes it on to the ranks and kills them 30 s later.)
  command=(bash -c 'trap "" USR1; exec "$@"' agent
    "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES" --nproc_per_node "$GPUS_PER_NODE"
    --rdzv-backend c10d --rdzv-endpoint "$head:${RDZV_PORT:-29500}" --rdzv-id "$SLURM_JOB_ID" "${train[@]}")
else
  # One rank per GPU. Every task sees all the node's GPUs and takes cuda:$SLURM_LOCALID, so
  # no per-task GPU binding here (--gpus-per-task / --gpu-bind would hide the others).
  srun_flags+=(--ntasks-per-node "$GPUS_PER_NODE" --cpus-per-task "$((cpus >= GPUS_PER_NODE ? cpus / GPUS_PER_NODE : 1))")
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # as torchrun sets it
  command=("$PYTHON" "${train[@]}")
fi

echo "[run_slurm] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_NNODES node(s): ${command[*]}"
status=0
srun "${srun_flags[@]}" "${command[@]}" || status=$?

# A run cut by the time limit (it got SIGUSR1 and saved) is not requeued by SLURM: do it here,
# when the job ended inside the signal window (SLURM may signal up to 60 s early). The requeued
# job resumes (--resume auto); one that had just finished finds its last checkpoint and stops.
job_end() { # the job's end in seconds since the epoch; 0 when unknown (no squeue, no limit)
  local end
  end="$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null)" || end=""
  if [ -n "$end" ] && date -d "$end" +%s 2>/dev/null; then return; fi
  echo 0
}
end="$(job_end)"
if [ "$end" -gt 0 ] && [ $((end - $(date +%s))) -le $((SIGNAL_SECONDS + 90)) ]; then
  if [ "${SLURM_RESTART_COUNT:-0}" -lt "${MAX_REQUEUES:-20}" ]; then
    echo "[run_slurm] time limit reached: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  echo "[run_slurm] time limit reached after ${MAX_REQUEUES:-20} requeues: not requeueing" >&2
fi
exit "$status"
