"""The HF rollout backend's decoding loop as it was before issue 54 (megarl/hf_rollout.py at 91b02c9): every
row in one left-padded batch, a DynamicCache grown by concatenation (and transformers' sdpa attention, its
key/value heads repeated), one exponential_ per row and step, two host transfers a step. The reference the
new loop's tokens and logprobs are compared with (tests/test_hf_rollout.py), and the old side of
bench/hf_rollout.py. Kept as it was: do not edit it to follow the engine."""

from __future__ import annotations

import contextlib

import torch

from megarl.hf_rollout import processed_logprobs


@contextlib.contextmanager
def old_engine(engine):
    """`engine` decoding as before: the old loop and transformers' sdpa attention."""
    implementation = engine.model.config._attn_implementation
    engine.model.set_attn_implementation("sdpa")
    engine._decode = lambda *args: _old_decode(engine, *args)
    try:
        yield engine
    finally:
        del engine._decode
        engine.model.set_attn_implementation(implementation)


def _old_decode(self, prompts, rows, temperature, min_tokens, held_back, finished):
    """Prefill every row's prompt (left-padded), then one token per step for the rows still going."""
    from transformers import DynamicCache

    args, device = self.args, self.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        prompt = prompts[row.prompt]
        ids[r, width - len(prompt):], mask[r, width - len(prompt):] = torch.tensor(prompt), 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each prompt's first token at position 0
    cache = DynamicCache(config=self.model.config)
    held = torch.tensor(held_back, dtype=torch.long, device=device)
    active = list(range(len(rows)))  # rows still generating, in batch order
    logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True, logits_to_keep=1).logits[:, -1]
    for t in range(args.max_new_tokens):
        logits = logits.float()
        if t < min_tokens and held.numel():
            logits[:, held] = -torch.inf  # vLLM's MinTokensLogitsProcessor, before temperature
        logprobs = processed_logprobs(logits, temperature, args.top_k, args.top_p)
        if temperature == 0.0:
            tokens = logits.argmax(dim=-1)
        else:  # vLLM's random_sample with per-request generators: argmax of probs / Exp(1) noise
            noise = torch.empty_like(logprobs)
            for b, r in enumerate(active):
                noise[b].exponential_(generator=rows[r].generator)
            tokens = (logprobs.exp() / noise).argmax(dim=-1)
        chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
        going = []
        for b, (r, token, logprob) in enumerate(zip(active, tokens.tolist(), chosen)):
            row = rows[r]
            row.add(token, logprob, self.stop_ids, args.max_new_tokens, min_tokens, args.stop, self.tokenizer)
            if row.done:
                finished(row)
            else:
                going.append(b)
        if not going:
            return
        if len(going) < len(active):  # drop the finished rows from the batch and the cache
            keep = torch.tensor(going, device=device)
            cache.reorder_cache(keep)
            mask, positions, tokens = mask[keep], positions[keep], tokens[keep]
            active = [active[b] for b in going]
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        positions = positions[:, -1:] + 1
        logits = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True).logits[:, -1]
