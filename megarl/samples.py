"""What a rollout returns and how its randomness is keyed: the `Sample` record (one prompt's response with its
logprobs, reward and bookkeeping) and the seeds of generation (`stable_seed`, `request_seeds`). Pure records and
hashing, below every engine (megarl/rollout.py, megarl/hf_rollout.py, megarl/multiturn.py) that fills them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


def stable_seed(*key) -> int:
    """A 63-bit seed from `key`, the same in every process and Python version (unlike hash())."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1


def request_seeds(seed: int, step: int, seed_key: tuple, prompt_indices: list[int]) -> list[int]:
    """The SamplingParams.seed of each prompt's request: from (--seed, step, seed_key, the prompt's index
    in the step), so not from the engine, its shard or what it sampled before. vLLM gives a request's
    j-th sample seed + j (ParentRequest._get_child_sampling_params): 55 bits leave room for any n below
    2**63 (Model Runner V2 keeps seeds as int64)."""
    return [stable_seed("request", seed, step, *seed_key, index) >> 8 for index in prompt_indices]


@dataclass
class Sample:
    prompt_index: int  # index of the prompt in this step's global prompt list
    prompt_ids: list[int]
    response_ids: list[int]
    response_text: str
    logprobs: list[float] | None  # rollout logprob of each response token; None: not the student's sample
    # (a dataset or teacher response, GKD's --gkd-lmbda / --seq-kd)
    truncated: bool  # hit max_new_tokens instead of ending
    reward: float = 0.0
    reason: str = ""  # the reward's short explanation ("wrong answer", "timeout", "error: ...")
    metadata: dict = field(default_factory=dict)  # the prompt's dataset row
    teacher_prompt_ids: list[int] | None = None  # OPSD: the teacher scores the response after this prompt
    weight_version: int = 0  # how many trainer -> rollout syncs the engine had taken when it sampled this
    # (its first token, where a response spans syncs: --partial-rollout)
    # --max-staleness (megarl/streaming.py): the weight version that sampled each response token; None: all
    # weight_version's
    token_versions: list[int] | None = None
    # vLLM's min_tokens: these token ids (EOS and the stop ids) had logit -inf before response token
    # `min_tokens` (0: nowhere); the trainer scores the policy under the same constraint (batch.sampler_constraint).
    min_tokens: int = 0
    held_back_ids: tuple[int, ...] = ()
    # A multi-turn episode (megarl/multiturn.py): the response is every token after the prompt, the policy's
    # turns and the tool results between them. policy_mask[j] is 1 where response token j is the policy's
    # own (sampled, with its rollout logprob) and 0 where a tool's result put it (logprob 0, never trained);
    # None: every response token is the policy's (a single turn).
    policy_mask: list[int] | None = None
    # The conversation after the prompt, as chat messages: {"role": "assistant", "content", "tool_calls"}
    # and {"role": "tool", "name", "content", "error", "seconds"} (what rewards and dumps read); None: one turn.
    turns: list[dict] | None = None
    # --routing-replay (megarl/routing_replay.py): int16 [p + r - 1, layers, k], the experts each MoE layer of
    # the engine routed each fed token to (every token but the last response token); None: not recorded.
    routes: torch.Tensor | None = None
