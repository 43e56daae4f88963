#!/usr/bin/env bash
# The main job: install (first run only), build the tiny models the config names if
# absent, and run GRPO on 2 ranks. Any extra arguments go to megarl/train.py, e.g.
#   bash run_quickstart.sh --train-steps 10
#   MEGARL_CONFIG=examples/quickstart_grpo_separate.yaml bash run_quickstart.sh
#   MEGARL_CONFIG=examples/quickstart_gkd.yaml bash run_quickstart.sh   # distillation
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# vLLM logs every engine step at INFO; keep the console to megarl's step lines.
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
config="${MEGARL_CONFIG:-examples/quickstart_grpo.yaml}"
# Every tiny model the config names (policy, teacher, MoE, tool-use, Qwen3.5), built once, offline.
.venv/bin/python tools/make_tiny_model.py --for-config "$config"
exec .venv/bin/torchrun --standalone --nproc_per_node "${NPROC:-2}" megarl/train.py --config "$config" "$@"
