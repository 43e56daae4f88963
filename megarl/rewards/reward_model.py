"""A learned reward model as a reward: the scalar head of an HF sequence classifier.

    rm = RewardModelReward("path/to/rm")        # AutoModelForSequenceClassification, num_labels=1
    rm(response, row)                           # RewardOutput(score=<logit>, reason="")
    rm.score_batch(responses, rows)             # [float, ...], batch_size at a time

What is scored: the prompt conversation ``row["messages"]`` plus the response as
an ``assistant`` turn (a multi-turn episode: its whole ``row["conversation"]``), rendered with the REWARD MODEL's own chat template (not
the policy's: the RM was trained on its own format) and tokenized with its own
tokenizer, special tokens coming from the template only.

Score: the raw logit of the single label (Bradley-Terry RMs are trained on logit
differences, so the logit is the natural scale); ``sigmoid=True`` maps it to (0, 1)
for combining with 0/1 rewards. The reason is empty (a combined reward shows the
number, e.g. "rm=0.37").

Pooling is the model's own: transformers scores the rightmost token that is not
the pad token, whichever side the padding is on. Position ids are computed from
the attention mask so left padding does not shift the positions either; left
and right padding therefore give the same score as an unpadded forward (up to
float rounding). A tokenizer without a pad token pads with EOS, and the model
config gets that pad id (transformers needs it to pool a batch).

Micro-batches (``batch_size``, --reward-model-micro-batch-size): the samples of a
call are scored that many at a time; scores do not depend on it.

``max_length`` (--reward-model-max-length, verl's reward-model max_length): a
conversation longer than that many tokens is truncated from the LEFT, keeping the
response's end, where the model pools (its beginning, the system prompt and the
start of the question, is dropped). Such samples are counted (``truncated``) and a
warning line says how many, the first time and whenever the count has doubled since.
Unset: no limit (the model's own position limit applies).

Device: the rollout rank's (`accelerator.device()`: its GPU, or the CPU), or the
one given. With ``offload`` (a reward model colocated with the trainer and vLLM on a
GPU) the weights wait in host memory between scoring calls and come onto the GPU for each
call (`accelerator.module_to_host` / `module_to_device`; no-ops on CPU). Every scoring call
makes the model's device the calling thread's current device first
(`accelerator.device_context`): with --reward-workers > 0 the calls come from pool threads,
whose current CUDA device would otherwise be cuda:0 on every rank (torch's device guards
restore it after each op without creating a context there, but the allocator's empty_cache,
library handles and anything that allocates on "the current device" would use GPU 0). The move
is per call: with --reward-workers > 0 a call is one prompt's samples, so on GPU
prefer --reward-workers 0 (one call per step) with an offloaded reward model.

Naming one from the command line: rewards are registered by name, but a reward
model needs a path, so this module registers nothing. The trainer builds the
spec itself (`make_reward_model_reward`), e.g. for ``--reward-model PATH``:

    rm = make_reward_model_reward(args.reward_model, name="rm")
    spec = rm if args.reward == "rm" else combined_reward_spec(args.reward, extra={"rm": rm})

so ``--reward rm`` uses the RM alone and ``--reward boxed:1.0,rm:0.5`` mixes it in
(megarl/rewards/combine.py).
"""

from __future__ import annotations

import threading

import torch

from megarl.rewards import RewardOutput, RewardSpec


class RewardModelReward:
    """`fn(response, row) -> RewardOutput` scoring with an HF reward model (see the module docstring)."""

    # Scored in the trainer even under --reward-timeout (megarl/rewards/workers.py): a worker process
    # would load the model again (and its GPU memory); a forward pass does not hang.
    in_process = True

    def __init__(self, path: str, device=None, batch_size: int = 8, dtype=None,
                 sigmoid: bool = False, max_length: int | None = None, padding_side: str = "right",
                 offload: bool = False):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from megarl import accelerator

        self.device = accelerator.device() if device is None else torch.device(device)
        self.batch_size, self.sigmoid, self.max_length, self.offload = batch_size, sigmoid, max_length, offload
        self.truncated, self._warn_at = 0, 1  # samples truncated to max_length so far; next warning's count
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side, self.tokenizer.truncation_side = padding_side, "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{path}: a reward model has num_labels=1, got {self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if offload:
            accelerator.module_to_host(self.model, self.device)
        self._lock = threading.Lock()  # one call at a time when rollout threads share the model

    def render(self, response: str, row: dict) -> str:
        """The conversation with the response as the assistant's turn, in the RM's chat template. A
        multi-turn episode (the row's `conversation`, megarl/multiturn.py: every assistant turn and tool
        message after the prompt, the response being its last assistant turn) is scored whole."""
        after = [{"role": "assistant", "content": response}]
        if row.get("conversation"):
            after = [{"role": m["role"], "content": m["content"]} for m in row["conversation"]]
        return self.tokenizer.apply_chat_template(list(row.get("messages") or []) + after, tokenize=False)

    @torch.no_grad()
    def score_batch(self, responses: list[str], rows: list[dict]) -> list[float]:
        from megarl import accelerator

        texts = [self.render(response, row) for response, row in zip(responses, rows, strict=True)]
        self._count_truncated(texts)
        scores = []
        with self._lock, accelerator.device_context(self.device):
            if self.offload:
                accelerator.module_to_device(self.model, self.device)
            try:
                for start in range(0, len(texts), self.batch_size):
                    scores += self._forward(texts[start:start + self.batch_size])
            finally:
                if self.offload:
                    accelerator.module_to_host(self.model, self.device)
        return scores

    def _count_truncated(self, texts: list[str]) -> None:
        if self.max_length is None:
            return
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        over = sum(length > self.max_length for length in lengths)
        if not over:
            return
        self.truncated += over
        if self.truncated >= self._warn_at:
            self._warn_at = 2 * self.truncated
            print(f"megarl: warning: reward model: {over} of {len(texts)} samples here ({self.truncated} so far) "
                  f"are longer than --reward-model-max-length {self.max_length} tokens (up to {max(lengths)}); "
                  f"scored on their last {self.max_length} tokens (the start of the conversation dropped)",
                  flush=True)

    def _forward(self, texts: list[str]) -> list[float]:
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False,
                             truncation=self.max_length is not None, max_length=self.max_length).to(self.device)
        # Positions count real tokens only, so left padding leaves them unchanged.
        position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = self.model(**enc, position_ids=position_ids).logits[:, 0].float()
        return (torch.sigmoid(logits) if self.sigmoid else logits).tolist()

    def __call__(self, response: str, row: dict) -> RewardOutput:  # score_batch is the batch path
        return RewardOutput(self.score_batch([response], [row])[0], "")


def make_reward_model_reward(path: str, name: str = "rm", **kwargs) -> RewardSpec:
    """A RewardSpec (no system prompt) for the reward model at `path`; kwargs go to RewardModelReward."""
    return RewardSpec(name, RewardModelReward(path, **kwargs), system_prompt=None)
