"""A learned reward model as a reward: the scalar head of an HF sequence classifier.

    rm = RewardModelReward("path/to/rm")        # AutoModelForSequenceClassification, num_labels=1
    rm(response, row)                           # RewardOutput(score=<logit>, reason="")
    rm.score_batch(responses, rows)             # [float, ...], batch_size at a time

What is scored: the prompt conversation ``row["messages"]`` plus the response as
an ``assistant`` turn, rendered with the REWARD MODEL's own chat template (not
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
``max_length`` truncates from the LEFT, keeping the response's end.

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

    # Scored in the trainer even under --reward-timeout (megarl/reward_workers.py): a worker process
    # would load the model again (and its GPU memory); a forward pass does not hang.
    in_process = True

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 8, dtype=None,
                 sigmoid: bool = False, max_length: int | None = None, padding_side: str = "right"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device, self.batch_size, self.sigmoid, self.max_length = device, batch_size, sigmoid, max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side, self.tokenizer.truncation_side = padding_side, "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{path}: a reward model has num_labels=1, got {self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self._lock = threading.Lock()  # one forward at a time when rollout threads share the model

    def render(self, response: str, row: dict) -> str:
        """The conversation with the response as the assistant's turn, in the RM's chat template."""
        conversation = list(row.get("messages") or []) + [{"role": "assistant", "content": response}]
        return self.tokenizer.apply_chat_template(conversation, tokenize=False)

    @torch.no_grad()
    def score_batch(self, responses: list[str], rows: list[dict]) -> list[float]:
        texts = [self.render(response, row) for response, row in zip(responses, rows, strict=True)]
        scores = []
        for start in range(0, len(texts), self.batch_size):
            scores += self._forward(texts[start:start + self.batch_size])
        return scores

    def _forward(self, texts: list[str]) -> list[float]:
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False,
                             truncation=self.max_length is not None, max_length=self.max_length).to(self.device)
        # Positions count real tokens only, so left padding leaves them unchanged.
        position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        with self._lock:
            logits = self.model(**enc, position_ids=position_ids).logits[:, 0].float()
        return (torch.sigmoid(logits) if self.sigmoid else logits).tolist()

    def __call__(self, response: str, row: dict) -> RewardOutput:  # score_batch is the batch path
        return RewardOutput(self.score_batch([response], [row])[0], "")


def make_reward_model_reward(path: str, name: str = "rm", **kwargs) -> RewardSpec:
    """A RewardSpec (no system prompt) for the reward model at `path`; kwargs go to RewardModelReward."""
    return RewardSpec(name, RewardModelReward(path, **kwargs), system_prompt=None)
