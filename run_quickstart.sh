#!/usr/bin/env bash
# The main job: install (first run only), build the built-in tiny model if absent,
# and run GRPO on 2 ranks. Any extra arguments go to megarl/train.py, e.g.
#   bash run_quickstart.sh --train-steps 10
#   MEGARL_CONFIG=examples/quickstart_grpo_separate.yaml bash run_quickstart.sh
#   MEGARL_CONFIG=examples/quickstart_gkd.yaml bash run_quickstart.sh   # distillation
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# vLLM logs every engine step at INFO; keep the console to megarl's step lines.
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
if [ ! -f artifacts/tiny-qwen2/megarl_tiny.json ]; then
  echo "[quickstart] building the built-in tiny model (about a minute)"
  .venv/bin/python tools/make_tiny_model.py --out artifacts/tiny-qwen2
fi
config="${MEGARL_CONFIG:-examples/quickstart_grpo.yaml}"
# The distillation quickstart (examples/quickstart_gkd.yaml) also needs the stronger teacher.
if grep -q "artifacts/tiny-qwen2-teacher" "$config" && [ ! -f artifacts/tiny-qwen2-teacher/megarl_tiny.json ]; then
  echo "[quickstart] building the tiny distillation teacher (a few minutes)"
  .venv/bin/python tools/make_tiny_model.py --teacher
fi
exec .venv/bin/torchrun --standalone --nproc_per_node "${NPROC:-2}" megarl/train.py --config "$config" "$@"
