"""PPO critic: a Megatron GPTModel whose output layer is a scalar value head.

The trunk (embeddings and decoder) is loaded from `--critic-model` (default: the
policy checkpoint), like verl's critic initialised from the actor. The head
replaces the vocabulary projection with Linear(hidden, 1) (HF's
`*ForTokenClassification` `score` layer, num_labels=1): loaded from the
checkpoint when it has `score.weight` (a critic saved before), otherwise
initialised N(0, initializer_range) with bias 0 (what HF does), from a generator
seeded by --seed so every rank starts identical.

The head is replicated on tensor-parallel ranks: its input (the final
layernorm's output, gathered over the sequence under sequence parallelism) is
identical on every TP rank, and each rank computes the same loss, so the trunk's
backward is the usual one and no TP reduction is needed for the head.

Value alignment: the value at position t is V(prefix up to token t), so the
value of response token j sits where that token's logprob does (p-1+j) and is
masked the same way; this is verl's values[:, -R-1:-1].

Loss: `algorithms.value_loss` (0.5 max of clipped and unclipped squared error,
clip range --value-clip around the values before the update), token mean over
the mini-batch (verl's default token-mean), with its own Adam and learning rate
(--critic-lr).
"""

from __future__ import annotations

import copy

import torch

from megarl.algorithms import value_loss
from megarl.model_runner import MicroBatch, TrainableModel, response_aligned
from megarl.models.convert import HFCheckpoint, load_hf_weights, unwrap
from megarl.models.megatron_gpt import DTYPES, build_gpt_model, trainer_config_overrides, whole_sequence


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer: hidden [s, b, h] -> values [s, b, 1] (under sequence
    parallelism the hidden states of the whole sequence first, as the output layer it replaces
    gathers them: megatron_gpt.whole_sequence)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device, config):
        super().__init__()
        self.score = torch.nn.Linear(hidden_size, 1, dtype=dtype, device=device)
        self.config = config

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return self.score(whole_sequence(hidden_states, self.config)), None


def attach_value_head(model, hf_config, checkpoint_path: str, seed: int) -> None:
    """Replace the model's vocabulary projection with a value head (see module docstring)."""
    gpt = unwrap(model)
    gpt.share_embeddings_and_output_weights = False  # the forward must not pass the embedding as weight
    if not gpt.post_process:  # the head belongs to the last pipeline stage
        return
    trunk = next(gpt.parameters())
    head = ValueHead(hf_config.hidden_size, trunk.dtype, trunk.device, gpt.config)
    checkpoint = HFCheckpoint(checkpoint_path)
    with torch.no_grad():
        if "score.weight" in checkpoint.weight_map:
            head.score.weight.copy_(checkpoint.get("score.weight").reshape(1, -1))
            if "score.bias" in checkpoint.weight_map:
                head.score.bias.copy_(checkpoint.get("score.bias").reshape(1))
            else:
                head.score.bias.zero_()
        else:
            generator = torch.Generator().manual_seed(seed)
            std = getattr(hf_config, "initializer_range", 0.02)
            head.score.weight.copy_(torch.randn(1, hf_config.hidden_size, generator=generator) * std)
            head.score.bias.zero_()
    gpt.output_layer = head


class Critic(TrainableModel):
    def __init__(self, args, hf_config):
        self.args = args
        # Tied layout: only the trunk is read from the checkpoint (no lm_head needed), so a
        # plain LM checkpoint and a saved critic (trunk + score) both load.
        trunk_config = copy.deepcopy(hf_config)
        trunk_config.tie_word_embeddings = True
        module = build_gpt_model(trunk_config, DTYPES[args.params_dtype], args.make_vocab_size_divisible_by,
                                 **trainer_config_overrides(args))
        load_hf_weights(module, args.critic_model, trunk_config)
        attach_value_head(module, hf_config, args.critic_model, args.seed)
        super().__init__(module, args, args.critic_lr, args.offload_model, args.offload_optimizer)

    def values(self, micro_batches: list[MicroBatch], width: int) -> torch.Tensor:
        """Response-aligned [n, width] values before the update."""
        outputs = self.forward_only(micro_batches, lambda batch, output, _: output.squeeze(-1).float())
        return response_aligned(micro_batches, outputs, width)

    def train_step(self, micro_batches: list[MicroBatch]) -> dict:
        """One optimizer step of the value loss over these micro-batches."""
        def loss(part, output, companion_outputs):
            values = part.gather(output.squeeze(-1).float())  # over whole sequences (context parallelism)
            batch = part.whole
            mask = batch.loss_mask
            token_loss, metrics = value_loss(values, batch.old_values, batch.returns, mask, self.args.value_clip)
            sums = {"value_loss": token_loss.sum(), "clipped": metrics["clipped"].sum(),
                    "values": (values * mask).sum(), "returns": (batch.returns * mask).sum(), "tokens": mask.sum()}
            sums = {name: value.detach() for name, value in sums.items()}
            return token_loss.sum(), mask.sum().round().to(torch.int), {"sums": sums}

        sums, grad_norm = self.optimizer_step(micro_batches, loss)
        tokens = max(sums["tokens"], 1.0)
        return {"value_loss": sums["value_loss"] / tokens, "value_clip_fraction": sums["clipped"] / tokens,
                "value_mean": sums["values"] / tokens, "returns_mean": sums["returns"] / tokens,
                "critic_grad_norm": grad_norm, "critic_lr": self.lr}
