"""Build megarl's tiny Qwen2 model and tokenizer for the arithmetic task, offline.

    python tools/make_tiny_model.py [--out artifacts/tiny-qwen2] [--seed 0] [--force]
    python tools/make_tiny_model.py --teacher   # the distillation teacher, artifacts/tiny-qwen2-teacher
    python tools/make_tiny_model.py --moe       # a mixture-of-experts policy, artifacts/tiny-qwen3-moe
    python tools/make_tiny_model.py --tools     # the tool-use policy, artifacts/tiny-qwen2-tools
    python tools/make_tiny_model.py --hints     # reads an answer hint (OPSD), artifacts/tiny-qwen2-hints
    python tools/make_tiny_model.py --family deepseek_v3   # a random DeepSeek-V3 (seconds), artifacts/tiny-deepseek-v3
    python tools/make_tiny_model.py --family glm4_moe      # a random GLM-4.5 (seconds), artifacts/tiny-glm4_moe
    python tools/make_tiny_model.py --family gpt_oss       # a random gpt-oss (seconds), artifacts/tiny-gpt_oss
    python tools/make_tiny_model.py --family nemotron_h    # a random Nemotron-H (seconds), artifacts/tiny-nemotron_h

Everything is made here from nothing, deterministically from --seed, in about a
minute on two CPU cores:
  1. a byte-level tokenizer (no merges: every byte, so every digit, is one token)
     plus the ChatML special tokens and a Qwen-style chat template;
  2. a ~0.3M-parameter, 2-layer Qwen2 (GQA, head_dim 32, tied embeddings, fp32) whose
     heads split evenly for tensor-parallel 2 and which vLLM's CPU backend runs;
  3. a supervised warm-up on chat-rendered problems, stopped part-way up the
     steep part of the learning curve (pass@1 at temperature 1 aimed at 25-50%),
     so that RL has room to lift it.
It ends by measuring pass@1 at T=1 and greedy accuracy on held-out problems and
writes them, the settings and the sha256 of the weights to <out>/megarl_tiny.json
(written last: its presence marks a complete model), and prints them.

Reproducibility: one thread, fixed seeds, problems drawn from --seed alone, and,
set below before torch is imported, the CPU code paths pinned to make the
floating-point result depend less on the machine's instruction set or vendor:
torch's own kernels run their AVX2 build (not AVX-512, whose wider vectors
change reduction orders), MKL's sgemm runs its conditional numerical
reproducibility branch COMPATIBLE (the only branch MKL honours on non-Intel
CPUs: AVX2/AVX512 fall back to AUTO there) and oneDNN is capped at AVX2. Each
pin changes the weights (measured on one AVX-512 machine: pass@1 0.31-0.41 over
the four torch x MKL combinations). Builds on one machine print the same weights
hash; the pins do not make it the same on every machine (an AMD EPYC and two
Intel Xeons, all with AVX-512, printed two different hashes): docs/testing.md,
"Reproducibility", has what was measured where.

--teacher builds the stronger teacher of the distillation quickstart
(examples/quickstart_gkd.yaml) into artifacts/tiny-qwen2-teacher: the same
tokenizer (so the same vocabulary), the same architecture, seed and pins, and
only a longer warm-up (1200 steps instead of 400: about three times the
student's build time), which lifted pass@1 at T=1 to 0.888 (greedy 0.906) on the
machine whose student build printed hash 6ce6c77b. Without --teacher nothing
changes: the default build's weights hash is the same as before the flag.

--moe builds a Qwen3-MoE of the same trunk (hidden 128, 2 layers, 4/2 heads of 32) whose MLPs are 8
routed experts of width 64, top-2 with renormalised weights (norm_topk_prob, as Qwen3-30B-A3B), no
shared expert, untied embeddings (as Qwen3-MoE), with the same tokenizer and warm-up recipe; the
routers learn during the warm-up, so routing is not uniform (the build prints each layer's expert
load on held-out prompts). transformers runs its per-expert loop (experts_implementation "eager":
deterministic, and the grouped GEMM has no deterministic CPU kernel). docs/moe.md.

--tools builds the policy of the multi-turn quickstart (examples/quickstart_grpo_tools.yaml,
docs/multiturn.md) into artifacts/tiny-qwen2-tools: the tiny model (--base, built first) fine-tuned on the
big-number task (operands up to 999,999, as --task-max-operand 999999 draws them: too long to add by heart)
where half of the problems, by a coin independent of the problem, are episodes that call the calculator
(Qwen2.5's Hermes `<tool_call>` JSON, the calculator's answer as the chat template writes a tool message,
no loss on it, then that answer boxed), the other half a boxed answer at once (mostly wrong: the model
cannot add these). So the model calls the calculator in about half of its episodes and GRPO has a
decision to learn: call it every time. The build plays held-out episodes at T=1 as a run does (the
hermes parser, the calculator, megarl.multiturn.TurnMessages) and prints the share that call, whose call
is right (operands copied), whose boxed answer copies the tool's result, and pass@1. The copies are what
takes the steps, and when they appear depends on the machine (its base's weights and MKL's branch): on
the machine the recipe was first measured on, none was right before ~300 steps and 500 steps gave calls
0.41, right calls 0.695, result copied 0.307, pass@1 0.08 (0.195 of the calling episodes); on an AMD EPYC
(base 6ce6c77b) 500 steps gave right calls 0.013, pass@1 0.0 under MKL_CBWR=COMPATIBLE (calls with garbled
JSON and operands: GRPO then gets no reward at all) and 0.143 / 0.02 unpinned; 1000 steps there: calls
0.61, right 0.664, copies 0.30, pass@1 0.115 (COMPATIBLE), calls 0.54, right 0.657, copies 0.663, pass@1
0.235 (unpinned). Hence 1000 steps. Copying is far from reliable there; GRPO improves it together with the
decision: the quickstart's 40 steps lifted the reward 0.125 -> 0.456 and the episodes that call from
0.33 to 0.95 (tests/test_multiturn.py::test_tool_quickstart_learns).
"""
import os
import sys

# CPU code-path pins; they only act if set before torch is first imported, so
# only when this file runs as a script (importing it, e.g. for build_tokenizer,
# must not change the importing process's environment).
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",   # torch's vectorized kernels: the AVX2 build on every machine
    "MKL_CBWR": "COMPATIBLE",        # MKL sgemm: one code branch, deterministic reductions
    "ONEDNN_MAX_CPU_ISA": "AVX2",    # oneDNN (not on this path today; pinned in case a torch routes through it)
    "DNNL_MAX_CPU_ISA": "AVX2",      # the same for older oneDNN spellings
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# --tools leaves MKL's branch unpinned: COMPATIBLE is MKL's SSE2 sgemm, 2.7x slower on its long episode rows
# (measured: 1.10 against 0.42 CPU s per step), and its weights start from this machine's tiny model, whose
# hash already differs between machines.
TOOLS_UNPINNED = ("MKL_CBWR",)
if __name__ == "__main__":
    os.environ.update({k: v for k, v in PINNED_ENV.items() if "--tools" not in sys.argv or k not in TOOLS_UNPINNED})

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,  # noqa: E402
                          Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.data.tasks import arithmetic  # noqa: E402

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2's ChatML layout, without Qwen's default system message (it would triple
# the prompt length of this task for nothing).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Model shape: 4 query / 2 KV heads split evenly over TP=2; head_dim 32 is one
# of the sizes vLLM's CPU attention supports.
MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
# Warm-up, measured to land pass@1 at T=1 between 30% and 40% (greedy a little
# higher): 0.312 on the pinned code path, 0.31-0.41 over the unpinned ones.
# Clipping and beta2 0.95 matter: without them the same run is under 10%.
TRAIN = dict(steps=400, batch=32, lr=3e-3, warmup=50, beta2=0.95, clip=1.0,
             weight_decay=0.0, threads=1)
EVAL = dict(num=500, seed_offset=10_000, max_new_tokens=16)
# --teacher: the same recipe trained longer, into its own directory.
TEACHER = dict(steps=1200, out="artifacts/tiny-qwen2-teacher")
# --tools: the tool-use policy of the multi-turn task (docs/multiturn.md), fine-tuned from the tiny model
# on the big-number task (operands up to max_operand, as --task-max-operand draws them): a call_share of
# the episodes call the calculator and box its result, the others box an answer at once.
TOOL_MODEL = dict(steps=1000, batch=32, lr=3e-3, warmup=20, max_operand=999_999, call_share=0.5,
                  base="artifacts/tiny-qwen2", out="artifacts/tiny-qwen2-tools")
TOOL_EVAL = dict(num=200, seed_offset=10_000)
# --hints: the policy of the self-distillation quickstart (examples/quickstart_opsd.yaml): the tiny model fine-tuned
# on problems of which a hint_share carry their answer as a hint (arithmetic.hinted, the OPSD teacher prompt),
# so that, as a real model reads a reference solution, it answers right when told the answer and about as
# before when not (measured on one machine: pass@1 at T=1 0.264 plain, 0.958 hinted).
HINT_MODEL = dict(steps=250, batch=32, lr=3e-3, warmup=20, hint_share=0.8, base="artifacts/tiny-qwen2",
                  out="artifacts/tiny-qwen2-hints")
# --moe: the same trunk with routed experts (8 of width 64, top 2) in every layer.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
           out="artifacts/tiny-qwen3-moe")
# --family qwen3_5: Qwen3.5's hybrid layers on the same trunk: layer 0 Gated DeltaNet (2 key heads of 32, 4 value
# heads of 32: each key head serves two, as Qwen3.5's 16 / 32), layer 1 gated softmax attention (head_dim 32, a
# quarter of it rotated), tied embeddings; with --moe its MLPs are MoE's routed experts plus a gated shared expert.
QWEN3_5 = dict(head_dim=32, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4)
QWEN3_5_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)
QWEN3_5_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128)
# --family deepseek_v3: DeepSeek-V3's architecture on the same trunk (hidden 128, 4 heads), random weights unless
# --steps asks for the warm-up (0 by default: built in seconds, for engine and RL-machinery checks; no pass@1 is
# measured then): multi-latent attention (q through a rank-64 pair, a kv latent of 512 plus a shared rope key of
# 64: the released models' widths, the only latent vLLM's CPU MLA decode kernel takes; heads of 32 nope + 64 rope
# dims and values of 32), 3 layers of which the first is dense, then 8 routed
# experts of width 64 under a sigmoid router with a random expert bias (e_score_correction_bias, std 0.2), 4 groups
# of 2 of which the best 2 are kept, top 4, routed_scaling_factor 2.5, one shared expert; untied embeddings.
DEEPSEEK_V3 = dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32,
                   qk_rope_head_dim=64, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=8,
                   num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                   first_k_dense_replace=1, norm_topk_prob=True, num_nextn_predict_layers=0)
DEEPSEEK_V3_BIAS_STD = 0.2
# --family glm4_moe: GLM-4.5's architecture on the same trunk, random unless --steps: grouped-query attention (4 heads
# of 32, 2 key-value heads) with q/k/v biases and q/k norms, half of each head rotated; 3 layers, the first dense,
# then DeepSeek-V3's MoE layers above (the sigmoid router with a random expert bias, std 0.2); untied embeddings.
GLM4_MOE = dict(num_hidden_layers=3, head_dim=32, attention_bias=True, use_qk_norm=True, moe_intermediate_size=64,
                n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, num_nextn_predict_layers=0)
GLM4_MOE_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
# --family gpt_oss: gpt-oss's architecture on the same trunk, random unless --steps: 4 heads of 32 (2 key-value
# heads) with biases and a learned sink each, sliding-window (16 tokens) and full layers in turn (2 of each), 8
# experts of width 64 with biases, top 2, the clamped SwiGLU, YaRN RoPE (factor 4 over an original 128, truncate
# false: the released models' kind); untied embeddings.
GPT_OSS = dict(num_hidden_layers=4, head_dim=32, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2)
GPT_OSS_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                    beta_fast=32.0, beta_slow=1.0, truncate=False)
# --family nemotron_h: Nemotron-H's hybrid layers on the same trunk, random unless --steps: one mixer per layer as
# the pattern says, M*M-E: Mamba-2 (8 heads of 16, 2 groups of B / C, state 16, conv 4), attention without RoPE (4
# heads of 32, 2 key-value heads), Mamba-2, a squared-ReLU MLP, and MoE (8 squared-ReLU experts of 64, top 2, under
# the sigmoid router with a random expert bias, routed_scaling_factor 2.5, a shared expert of 128); untied.
NEMOTRON_H = dict(num_hidden_layers=5, hybrid_override_pattern="M*M-E", head_dim=32, mamba_num_heads=8,
                  mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                  moe_shared_expert_intermediate_size=128, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True)
# The families built random by default (--steps 0): their MoE shape, their RoPE (None: none)
RANDOM_FAMILIES = {"deepseek_v3": (DEEPSEEK_V3, dict(rope_type="default", rope_theta=10000.0)),
                   "glm4_moe": (GLM4_MOE, GLM4_MOE_ROPE), "gpt_oss": (GPT_OSS, GPT_OSS_ROPE),
                   "nemotron_h": (NEMOTRON_H, None)}
# --warm: the policy of those families warmed up for the learning lane (tests/test_moe.py's learning test, tools/
# learning_bars.py), the steps each needs to start GRPO where it can learn: GLM-4.5 after the standard 400 reads
# pass@1 0.47; DeepSeek-V3 read 0.07 after 400 and learnt little in 200 GRPO steps from there, 0.19 after 1200
# (docs/testing.md, "Learning bars"); gpt-oss: WARM_UP_LR.
WARM_UP = {"deepseek_v3": 1200, "glm4_moe": 400, "gpt_oss": 300, "nemotron_h": 400}
# gpt-oss's warm-up at the recipe's lr 3e-3 is unsteady (pass@1 0.21 after 1200 steps, 0.15 after 2400); at 1e-3 it
# reads 0.82 after 1200 steps (too strong to rise much) and 0.30 after 300, the lane's start
WARM_UP_LR = {"gpt_oss": 1e-3}
# Where each build goes by default: (family, kind) -> directory
OUTS = {**{(family, "warm"): f"artifacts/tiny-{family}-warm" for family in WARM_UP},
        ("qwen2", "policy"): "artifacts/tiny-qwen2", ("qwen2", "teacher"): TEACHER["out"],
        ("qwen2", "moe"): MOE["out"], ("qwen2", "tools"): TOOL_MODEL["out"], ("qwen2", "hints"): HINT_MODEL["out"],
        ("qwen3_5", "policy"): "artifacts/tiny-qwen3_5", ("qwen3_5", "teacher"): "artifacts/tiny-qwen3_5-teacher",
        ("qwen3_5", "moe"): "artifacts/tiny-qwen3_5-moe", ("deepseek_v3", "policy"): "artifacts/tiny-deepseek-v3",
        ("glm4_moe", "policy"): "artifacts/tiny-glm4_moe", ("gpt_oss", "policy"): "artifacts/tiny-gpt_oss",
        ("nemotron_h", "policy"): "artifacts/tiny-nemotron_h"}


def build_tokenizer():
    """Byte-level BPE trained with zero merges, wrapped for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS, IM_START, IM_END]
    # vocab = specials + the 256 byte symbols, so the trainer learns no merges.
    trainer = trainers.BpeTrainer(vocab_size=len(specials) + 256, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # With no merges to learn, the corpus only has to exist.
    tok.train_from_iterator([p["prompt"] for p in arithmetic.make_problems(100, 0)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE, model_max_length=MODEL["max_position_embeddings"])


def stop_ids(tokenizer):
    """Generation ends on either <|im_end|> (end of turn) or <|endoftext|>."""
    return [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]


def build_model(tokenizer, seed, moe: bool = False, family: str = "qwen2"):
    torch.manual_seed(seed)
    special = dict(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                   dtype="float32")
    if family in RANDOM_FAMILIES:
        from transformers import AutoConfig, AutoModelForCausalLM

        shape, rope = RANDOM_FAMILIES[family]
        config = AutoConfig.for_model(family, vocab_size=len(tokenizer), tie_word_embeddings=False,
                                      **(dict(rope_parameters=dict(rope)) if rope else {}), **special,
                                      **{**MODEL, **shape})
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(std=DEEPSEEK_V3_BIAS_STD)
        return model
    if family == "qwen3_5":
        trunk = {key: value for key, value in MODEL.items() if not (moe and key == "intermediate_size")}
        if moe:
            config = Qwen3_5MoeTextConfig(vocab_size=len(tokenizer), tie_word_embeddings=True,
                                          rope_parameters=dict(QWEN3_5_ROPE), **special, **QWEN3_5, **QWEN3_5_MOE,
                                          **trunk)
            return Qwen3_5MoeForCausalLM._from_config(config, experts_implementation="eager")
        config = Qwen3_5TextConfig(vocab_size=len(tokenizer), tie_word_embeddings=True,
                                   rope_parameters=dict(QWEN3_5_ROPE), **special, **QWEN3_5, **trunk)
        return Qwen3_5ForCausalLM(config)
    if moe:
        config = Qwen3MoeConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, bos_token_id=None,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                rope_theta=10000.0, dtype="float32", head_dim=32,
                                **{k: v for k, v in MOE.items() if k != "out"}, **MODEL)
        return Qwen3MoeForCausalLM._from_config(config, experts_implementation="eager")
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, rope_theta=10000.0,
                         dtype="float32", **MODEL)
    return Qwen2ForCausalLM(config)


def render(tokenizer, problem):
    """The chat-rendered prompt, ending where the assistant's answer starts."""
    messages = [{"role": "user", "content": problem["prompt"]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def sft_batch(tokenizer, problems):
    """Right-padded input ids and labels; only the response tokens carry loss.

    Right padding needs no attention mask under causal attention: real tokens
    never look at the pads after them.
    """
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    rows = []
    for p in problems:
        prompt = tokenizer.encode(render(tokenizer, p))
        response = tokenizer.encode(arithmetic.format_response(p["answer"])) + [im_end]
        rows.append((prompt + response, [-100] * len(prompt) + response))
    return padded(tokenizer, rows)


def padded(tokenizer, rows):
    """[(ids, labels)] as right-padded tensors (pads carry no loss)."""
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([target + [-100] * (width - len(target)) for _, target in rows])
    return ids, labels


def train(model, tokenizer, seed, steps, batch, lr, warmup, beta2, clip, weight_decay, quiet, make_batch=sft_batch,
          problems=None, **_):
    """Plain AdamW loop on freshly drawn problems, linear warm-up then constant lr. `make_batch(tokenizer,
    problems)` makes a step's (ids, labels) from its `batch` problems (default: drawn from `seed`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, beta2), weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    if problems is None:
        problems = arithmetic.make_problems(steps * batch, seed)
    model.train()
    start = time.time()
    for step in range(steps):
        ids, labels = make_batch(tokenizer, problems[step * batch:(step + 1) * batch])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if not quiet and (step % 50 == 0 or step == steps - 1):
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:5.1f}s", flush=True)
    model.eval()


@torch.no_grad()
def accuracy(model, tokenizer, problems, temperature, seed, max_new_tokens):
    """Fraction of problems whose (single) response scores 1; greedy if temperature is 0."""
    enc = tokenizer([render(tokenizer, p) for p in problems], return_tensors="pt",
                    padding=True, padding_side="left")
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
        if temperature > 0 else dict(do_sample=False)
    torch.manual_seed(seed)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=stop_ids(tokenizer), **sampling)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(arithmetic.score(t, p["answer"]) for t, p in zip(texts, problems)) / len(problems)


@torch.no_grad()
def expert_load(model, tokenizer, problems) -> list[list[float]]:
    """Per MoE layer, the share of the prompts' routed (token, slot) pairs that each expert receives."""
    loads = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda module, inputs, output: loads.append(output[2].flatten()))
             for layer in model.model.layers]
    enc = tokenizer([render(tokenizer, p) for p in problems], return_tensors="pt", padding=True)
    model(**enc)
    for hook in hooks:
        hook.remove()
    experts = model.config.num_experts
    return [(torch.bincount(chosen, minlength=experts).float() / chosen.numel()).tolist() for chosen in loads]


# ------------------------------------------------------------------------------------------------ --tools
def tool_prompt_ids(tokenizer, problem):
    """The problem as megarl renders the tool task (data/sources.py: the calculator listed through `tools=`;
    the tiny template ignores the list, so the prompt is the plain task's)."""
    from megarl.data.prompts import render_chat
    from megarl.tools import tool_schemas

    return render_chat(tokenizer, problem["prompt"], tools=tool_schemas(["calculator"]))


def tool_call_text(expression):
    """The assistant turn that asks the calculator for `expression`, as Qwen2.5 writes a call (what megarl's
    `hermes` parser reads)."""
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"


def tool_problems(num, seed, max_operand, call_share):
    """Problems of the tool task, each marked `call` (the episode calls the calculator) with probability
    `call_share`, independently of the problem: the model learns to call about that often, whatever it is asked."""
    import random

    coin = random.Random(seed + 1)
    return [dict(p, call=coin.random() < call_share) for p in arithmetic.make_problems(num, seed, max_operand)]


def tool_batch(tokenizer, problems):
    """Like sft_batch, for episodes. A `call` problem: the call turn, the calculator's result as the tool
    message the chat template writes after it (megarl.multiturn.TurnMessages, exactly what the policy reads
    in a run; no loss on it), then the boxed answer copied from it. Otherwise the boxed answer at once."""
    from megarl.multiturn import TurnMessages, tool_messages
    from megarl.tools import TOOLS, ToolResult

    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    turn_messages = TurnMessages(tokenizer, tuple(stop_ids(tokenizer)))
    rows = []
    for p in problems:
        prompt = tool_prompt_ids(tokenizer, p)
        answer = tokenizer.encode(arithmetic.format_response(p["answer"])) + [im_end]
        if not p["call"]:
            rows.append((prompt + answer, [-100] * len(prompt) + answer))
            continue
        expression = p["prompt"].removeprefix("What is ").removesuffix("?")
        call = tokenizer.encode(tool_call_text(expression)) + [im_end]
        value = TOOLS["calculator"].function(expression=expression)
        tool = turn_messages.ids(tool_messages([ToolResult("calculator", value)]), ended_with_stop=True)
        rows.append((prompt + call + tool + answer, [-100] * len(prompt) + call + [-100] * len(tool) + answer))
    return padded(tokenizer, rows)


@torch.no_grad()
def generate_turns(model, tokenizer, prompts, temperature, max_new_tokens):
    """One sampled turn per prompt (token-id lists, left-padded together): each turn's ids up to and with
    its stop token, and whether it stopped."""
    pad = tokenizer.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                         eos_token_id=stop_ids(tokenizer), do_sample=True, temperature=temperature, top_k=0,
                         top_p=1.0)[:, width:].tolist()
    stops, turns = set(stop_ids(tokenizer)), []
    for row in out:
        end = next((i + 1 for i, token in enumerate(row) if token in stops), None)
        turns.append((row[:end] if end else row, end is not None))
    return turns


def tool_episodes(model, tokenizer, problems, temperature, seed, max_new_tokens=(128, 32)):
    """Two-turn episodes of the tool task at `temperature`, as a multi-turn run plays them (megarl's hermes
    parser, ToolRunner and TurnMessages; a second turn only after a call). Returns the measures of the
    build's report: the share of first turns that call the calculator, of calls whose result is the answer
    (the operands copied right), of answered episodes whose boxed answer is the tool's result (copied
    right), and pass@1 overall, after a call and without one."""
    from megarl.multiturn import TurnMessages, tool_messages
    from megarl.tools import ToolRunner, parse_hermes

    torch.manual_seed(seed)
    runner = ToolRunner(["calculator"], 1, 10.0)
    turn_messages = TurnMessages(tokenizer, tuple(stop_ids(tokenizer)))
    prompts = [tool_prompt_ids(tokenizer, p) for p in problems]
    first = generate_turns(model, tokenizer, prompts, temperature, max_new_tokens[0])
    called, results = [], {}
    for i, (turn, stopped) in enumerate(first):
        calls = parse_hermes(tokenizer.decode(turn, skip_special_tokens=True))
        if calls:
            handles = [runner.start(call, None) for call in calls]
            for handle in handles:
                if not hasattr(handle, "content"):
                    handle.future.exception()  # wait for it
            results[i] = [runner.result(handle) for handle in handles]
            called.append(i)
    runner.close()
    followed = [prompts[i] + first[i][0] + turn_messages.ids(tool_messages(results[i]), first[i][1]) for i in called]
    second = generate_turns(model, tokenizer, followed, temperature, max_new_tokens[1]) if called else []
    final = {i: tokenizer.decode(first[i][0], skip_special_tokens=True) for i in range(len(problems))}
    final.update({i: tokenizer.decode(turn, skip_special_tokens=True) for i, (turn, _) in zip(called, second)})
    scores = [arithmetic.score(final[i], p["answer"]) for i, p in enumerate(problems)]
    answered = [i for i in called if results[i][0].error is None]
    direct = [i for i in range(len(problems)) if i not in results]

    def share(values):
        return round(sum(values) / len(values), 3) if values else None

    return dict(call_rate=share([i in results for i in range(len(problems))]),
                right_call=share([results[i][0].content == problems[i]["answer"] for i in called]),
                copy_accuracy=share([arithmetic.score(final[i], results[i][0].content) for i in answered]),
                pass_at_1=share(scores), pass_at_1_called=share([scores[i] for i in called]),
                pass_at_1_direct=share([scores[i] for i in direct]))


def weights_sha256(model_dir):
    """sha256 of a checkpoint's weights, independent of file layout and metadata.

    Over every tensor of the directory's *.safetensors files in sorted-name order:
    the name, the dtype, the shape and the raw (little-endian) bytes.
    """
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous().reshape(-1)
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save(model, tokenizer, out, report):
    """Write into a temporary sibling, then swap it in: a killed build leaves no half model.

    Adds the weights' hash, as written, to ``report``.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config = GenerationConfig(eos_token_id=stop_ids(tokenizer),
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    report["weights_sha256"] = weights_sha256(tmp)
    (tmp / "megarl_tiny.json").write_text(json.dumps(report, indent=2) + "\n")
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def build_tool_model(args, settings, start, capability):
    """--tools: the tiny model (--base: its tokenizer, chat template and boxed answers) fine-tuned on tool
    episodes mixed with direct answers; measured on held-out problems as a multi-turn run plays them."""
    settings.update({k: v for k, v in TOOL_MODEL.items() if k not in ("base", "out")}, steps=args.steps)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.base)
    model = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    base = json.loads((args.base / "megarl_tiny.json").read_text())
    problems = tool_problems(settings["steps"] * settings["batch"], args.seed, settings["max_operand"],
                             settings["call_share"])
    train(model, tokenizer, args.seed, quiet=args.quiet, make_batch=tool_batch, problems=problems, **settings)
    held_out = arithmetic.make_problems(TOOL_EVAL["num"], args.seed + TOOL_EVAL["seed_offset"], settings["max_operand"])
    measured = tool_episodes(model, tokenizer, held_out, 1.0, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    report = dict(seed=args.seed, params=n_params, model=MODEL, base=str(args.base),
                  base_weights_sha256=base["weights_sha256"], train=settings, eval=TOOL_EVAL, t1=measured,
                  build_seconds=round(time.time() - start, 1), torch=torch.__version__,
                  transformers=transformers.__version__, cpu_capability=capability,
                  pinned_env={k: os.environ.get(k) for k in PINNED_ENV})
    save(model, tokenizer, args.out, report)
    print(f"{args.out}: held-out episodes at T=1: calls the calculator {measured['call_rate']}, right call "
          f"{measured['right_call']}, copies its result {measured['copy_accuracy']}, pass@1 {measured['pass_at_1']} "
          f"(called {measured['pass_at_1_called']}, direct {measured['pass_at_1_direct']}), "
          f"{report['build_seconds']}s\nweights sha256 {report['weights_sha256']}")
    if not measured["pass_at_1"] or (measured["right_call"] or 0) < 0.3:
        print(f"warning: {args.out} rarely calls the calculator right (right call {measured['right_call']}, pass@1 "
              f"{measured['pass_at_1']}): the multi-turn quickstart's GRPO gets little or no reward from it; more "
              f"--steps let the copying appear", file=sys.stderr)


def build_hint_model(args, settings, start, capability):
    """--hints: the tiny model (--base) fine-tuned on problems, a hint_share of them with their answer as a
    hint in the prompt; measured on held-out problems with and without the hint."""
    import random

    settings.update({k: v for k, v in HINT_MODEL.items() if k not in ("base", "out")}, steps=args.steps)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.base)
    model = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    base = json.loads((args.base / "megarl_tiny.json").read_text())
    coin = random.Random(args.seed + 5)  # which problems carry the hint: independent of the problem
    problems = [dict(p, prompt=arithmetic.hinted(p)) if coin.random() < settings["hint_share"] else p
                for p in arithmetic.make_problems(settings["steps"] * settings["batch"], args.seed + 101)]
    train(model, tokenizer, args.seed, quiet=args.quiet, problems=problems, **settings)
    held_out = arithmetic.make_problems(EVAL["num"], args.seed + EVAL["seed_offset"])
    plain = accuracy(model, tokenizer, held_out, 1.0, args.seed, EVAL["max_new_tokens"])
    hinted = accuracy(model, tokenizer, [dict(p, prompt=arithmetic.hinted(p)) for p in held_out], 1.0, args.seed,
                      EVAL["max_new_tokens"])
    report = dict(seed=args.seed, params=sum(p.numel() for p in model.parameters()), model=MODEL, base=str(args.base),
                  base_weights_sha256=base["weights_sha256"], train=settings, eval=EVAL, pass_at_1_t1=plain,
                  pass_at_1_t1_hinted=hinted, build_seconds=round(time.time() - start, 1), torch=torch.__version__,
                  transformers=transformers.__version__, cpu_capability=capability,
                  pinned_env={k: os.environ.get(k) for k in PINNED_ENV})
    save(model, tokenizer, args.out, report)
    print(f"{args.out}: pass@1 (T=1) {plain:.3f} plain, {hinted:.3f} with the answer as a hint, "
          f"{report['build_seconds']}s\nweights sha256 {report['weights_sha256']}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help=f"default: artifacts/tiny-<family>, -teacher with --teacher ({TEACHER['out']} for qwen2), "
                         f"-moe with --moe")
    ap.add_argument("--family", choices=("qwen2", "qwen3_5", *RANDOM_FAMILIES), default="qwen2",
                    help="qwen3_5: Qwen3.5's hybrid Gated DeltaNet / gated-attention layers on the same trunk "
                         "(the policy, --teacher or --moe; the same tokenizer, recipe and pins); deepseek_v3: "
                         "DeepSeek-V3's MLA and sigmoid-routed MoE layers; glm4_moe: GLM-4.5's attention and the same "
                         "MoE layers; gpt_oss: gpt-oss's; these three random unless --steps (the policy only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None,
                    help=f"warm-up steps (default: {TRAIN['steps']}, or {TEACHER['steps']} with --teacher)")
    ap.add_argument("--teacher", action="store_true",
                    help="build the stronger distillation teacher (same tokenizer, longer warm-up)")
    ap.add_argument("--moe", action="store_true",
                    help=f"build a Qwen3-MoE policy (same tokenizer and recipe) into {MOE['out']}")
    ap.add_argument("--tools", action="store_true",
                    help=f"build the tool-use policy of the multi-turn task into {TOOL_MODEL['out']}, fine-tuned "
                         f"from --base (docs/multiturn.md)")
    ap.add_argument("--hints", action="store_true",
                    help=f"build the self-distillation quickstart's policy, which reads an answer hint, into "
                         f"{HINT_MODEL['out']}, fine-tuned from --base")
    ap.add_argument("--base", type=Path, default=Path(TOOL_MODEL["base"]),
                    help="--tools, --hints: the tiny model it starts from (built by this script without flags)")
    ap.add_argument("--warm", action="store_true",
                    help=f"--family {', '.join(WARM_UP)}: the policy warmed up for the learning lane "
                         f"({', '.join(f'{f} {n}' for f, n in WARM_UP.items())} steps) into artifacts/tiny-<family>-warm")
    ap.add_argument("--for-config", type=Path, default=None, metavar="YAML",
                    help="build every tiny model that this megarl config names and that is not built yet (its "
                         "model, teacher, reference, critic and rollout paths; run_quickstart.sh calls this)")
    ap.add_argument("--for-model", type=Path, default=None, metavar="DIR",
                    help="build DIR if it is one of this script's default outputs and not built yet")
    ap.add_argument("--force", action="store_true", help="rebuild over a complete model")
    ap.add_argument("--quiet", action="store_true")
    return ap


# The config keys that name a checkpoint (megarl/arguments.py), top level and in the role sections.
MODEL_KEYS = ("model", "teacher_model", "ref_model", "critic_model", "rollout_model")


def models_named(config_path: Path) -> list[Path]:
    """The checkpoint paths a megarl YAML config names, in the order they appear."""
    import yaml

    config = yaml.safe_load(config_path.read_text()) or {}
    sections = [config] + [value for value in config.values() if isinstance(value, dict)]
    return [Path(section[key]) for section in sections for key in MODEL_KEYS if isinstance(section.get(key), str)]


# The arithmetic problems file the OPSD examples read (their preprocessor gives each a hinted teacher prompt).
PROBLEMS_FILE = dict(path="artifacts/arithmetic.jsonl", num=5000, seed=5)


def build_for_config(config_path: Path) -> None:
    """Build, one subprocess each (so that each gets this file's pins), the tiny models the config names that
    are missing; the tool model's base first. Paths that are no tiny model of this script are left alone. The
    arithmetic problems file, where the config trains on it and it is missing, is written too."""
    import yaml

    data = (yaml.safe_load(config_path.read_text()) or {}).get("train_data") or []
    if PROBLEMS_FILE["path"] in data and not Path(PROBLEMS_FILE["path"]).exists():
        Path(PROBLEMS_FILE["path"]).parent.mkdir(parents=True, exist_ok=True)
        arithmetic.write_jsonl(PROBLEMS_FILE["path"], arithmetic.make_problems(PROBLEMS_FILE["num"], PROBLEMS_FILE["seed"]))

    build_missing(models_named(config_path), f"for {config_path}")


def build_missing(paths: list[Path], why: str) -> None:
    """Build those of `paths` that are this script's default outputs and hold no complete model yet (the tool and
    hint models' base first), one subprocess each."""
    import subprocess

    flags = {Path(out): (family, kind) for (family, kind), out in OUTS.items()}
    wanted = [path for path in paths if path in flags]
    if any(Path(built["out"]) in wanted for built in (TOOL_MODEL, HINT_MODEL)):  # their base first
        wanted.insert(0, Path(TOOL_MODEL["base"]))
    for path in dict.fromkeys(wanted):
        if (path / "megarl_tiny.json").exists():
            continue
        family, kind = flags[path]
        extra = [] if kind == "policy" else [f"--{kind}"]
        print(f"[tiny models] building {path}{' ' + why if why else ''} (a few minutes)", flush=True)
        # this process pinned every PINNED_ENV entry; the tool model's build leaves TOOLS_UNPINNED unset
        # (inherited, MKL_CBWR=COMPATIBLE made it 2.7x slower and changed what its 1000 steps learn)
        env = {key: value for key, value in os.environ.items() if kind != "tools" or key not in TOOLS_UNPINNED}
        subprocess.run([sys.executable, __file__, "--family", family, *extra, "--out", str(path), "--quiet"],
                       check=True, env=env)


def main():
    args = build_parser().parse_args()
    if args.for_config is not None:
        return build_for_config(args.for_config)
    if args.for_model is not None:
        return build_missing([args.for_model], "")
    if args.teacher + args.moe + args.tools + args.hints + args.warm > 1:
        sys.exit("--teacher, --moe, --tools, --hints and --warm: choose one")
    kind = "teacher" if args.teacher else "moe" if args.moe else "tools" if args.tools else \
        "hints" if args.hints else "warm" if args.warm else "policy"
    if (args.family, kind) not in OUTS:
        builds = "the policy and --warm" if args.family in RANDOM_FAMILIES else "the policy, --teacher and --moe"
        sys.exit(f"--family {args.family} builds {builds}, not --{kind}")
    if args.out is None:
        args.out = Path(OUTS[args.family, kind])
    if args.steps is None and args.warm:
        args.steps = WARM_UP[args.family]
    if args.steps is None and args.family in RANDOM_FAMILIES:
        args.steps = 0  # random weights: seconds to build
    if args.steps is None:
        args.steps = TEACHER["steps"] if args.teacher else TOOL_MODEL["steps"] if args.tools else \
            HINT_MODEL["steps"] if args.hints else TRAIN["steps"]
    if (args.tools or args.hints) and not (args.base / "megarl_tiny.json").exists():
        sys.exit(f"--{kind} starts from the tiny model, and {args.base} holds none: build it first "
                 f"(python tools/make_tiny_model.py --out {args.base})")
    if (args.out / "megarl_tiny.json").exists() and not args.force:
        sys.exit(f"{args.out} already holds a complete tiny model; pass --force to rebuild it")

    if args.quiet:
        transformers.utils.logging.disable_progress_bar()
    start = time.time()
    # A fixed thread count keeps float reductions, hence the result, reproducible;
    # the CPU code paths are pinned by PINNED_ENV at the top of this file.
    torch.set_num_threads(TRAIN["threads"])
    torch.use_deterministic_algorithms(True)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        print(f"note: torch runs its {capability} kernels here (no AVX2, or {PINNED_ENV['ATEN_CPU_CAPABILITY']} "
              "not pinned): the weights will differ from an AVX2 machine's", file=sys.stderr)
    settings = dict(TRAIN, steps=args.steps)
    if args.warm and args.family in WARM_UP_LR:
        settings["lr"] = WARM_UP_LR[args.family]
    if args.tools:
        return build_tool_model(args, settings, start, capability)
    if args.hints:
        return build_hint_model(args, settings, start, capability)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed, moe=args.moe, family=args.family)
    n_params = sum(p.numel() for p in model.parameters())
    train(model, tokenizer, args.seed, quiet=args.quiet, **settings)

    held_out = arithmetic.make_problems(EVAL["num"], args.seed + EVAL["seed_offset"])
    if settings["steps"] == 0:  # a random model (deepseek_v3's and glm4_moe's default): nothing learnt to measure
        pass1 = greedy = None
    else:
        pass1 = accuracy(model, tokenizer, held_out, 1.0, args.seed, EVAL["max_new_tokens"])
        greedy = accuracy(model, tokenizer, held_out, 0.0, args.seed, EVAL["max_new_tokens"])
    if args.moe:
        load = expert_load(model, tokenizer, held_out[:100])
        print("expert load per layer (share of routed tokens):",
              [[round(share, 3) for share in layer] for layer in load])
    shape = dict(MODEL, **QWEN3_5, rope=QWEN3_5_ROPE, **(QWEN3_5_MOE if args.moe else {})) \
        if args.family == "qwen3_5" else \
        {**MODEL, **RANDOM_FAMILIES[args.family][0], "rope": RANDOM_FAMILIES[args.family][1]} \
        if args.family in RANDOM_FAMILIES \
        else dict(MODEL, **MOE) if args.moe else MODEL
    report = dict(seed=args.seed, family=args.family, params=n_params, model=shape,
                  train=settings, eval=EVAL,
                  max_operand=arithmetic.MAX_OPERAND, pass_at_1_t1=pass1, greedy_accuracy=greedy,
                  build_seconds=round(time.time() - start, 1),
                  torch=torch.__version__, transformers=transformers.__version__,
                  cpu_capability=capability, pinned_env={k: os.environ.get(k) for k in PINNED_ENV})
    save(model, tokenizer, args.out, report)
    measured = "random weights (no warm-up)" if pass1 is None else f"pass@1 (T=1) {pass1:.3f}, greedy {greedy:.3f}"
    print(f"{args.out}: {n_params} params, {measured}, {report['build_seconds']}s\n"
          f"weights sha256 {report['weights_sha256']}")


if __name__ == "__main__":
    main()
