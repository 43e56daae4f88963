"""The trainer's speed paths on CPU hosts (issue 28) compute what the plain paths compute, within fp32 rounding:
torch's fused Adam against its per-parameter loop, packed attention by scaled_dot_product_attention against
Megatron's local attention. In-process, one Megatron rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_fp32_paths_agree, micro_batches, nll

from megarl import cpu_gemm


def actor_of(model: str):
    from transformers import AutoConfig

    from megarl.actor import Actor
    from megarl.arguments import parse_args

    args = parse_args(["--model", model, "--lr", "1e-2", "--micro-batch-size", "2"], world_size=1)
    return Actor(args, AutoConfig.from_pretrained(model))


def adam_groups(optimizer):
    return [group for part in getattr(optimizer, "chained_optimizers", [optimizer])
            for group in part.optimizer.param_groups]


def test_cpu_adam_is_torchs_fused_kernel_and_steps_as_its_loop(megatron_rank, tiny_model, monkeypatch):
    from megarl import accelerator

    fused = actor_of(tiny_model)
    assert adam_groups(fused.optimizer) and all(group["fused"] for group in adam_groups(fused.optimizer))
    monkeypatch.setattr(accelerator, "fuse_torch_adam", lambda optimizer: 0)
    loop = actor_of(tiny_model)
    assert not any(group["fused"] for group in adam_groups(loop.optimizer))
    before = {name: param.detach().clone() for name, param in fused.model.named_parameters()}
    batches = micro_batches(seed=1)
    for actor in (fused, loop):  # one step: the same gradients, then each Adam's update
        actor.optimizer_step(batches, nll)
    named = dict(loop.model.named_parameters())
    for name, param in fused.model.named_parameters():
        assert not torch.equal(param, before[name]), f"{name} did not move"
        assert_fp32_paths_agree(param.detach(), named[name].detach(), name)


@pytest.mark.parametrize("fused,amsgrad", [(True, False), (False, False), (False, True)])
def test_adam_states_made_at_start_are_the_ones_torch_makes_at_its_first_step(fused, amsgrad):
    """accelerator.allocate_adam_states_on_host against torch's own lazy creation: after two steps on the same
    gradients, the same state (keys, dtypes, devices, values) and the same parameters, bit for bit."""
    from types import SimpleNamespace

    from megarl import accelerator

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]
    gradients = [[torch.randn(p.shape, generator=generator) for p in start] for _ in range(2)]
    runs = {}
    for eager in (True, False):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused, amsgrad=amsgrad)
        if eager:
            assert accelerator.allocate_adam_states_on_host(SimpleNamespace(optimizer=optimizer)) == len(params)
            assert all(optimizer.state[p]["step"] == 0 for p in params)
        for step_gradients in gradients:
            for param, gradient in zip(params, step_gradients):
                param.grad = gradient.clone()
            optimizer.step()
        runs[eager] = (params, [optimizer.state[p] for p in params])
    for (eager_param, eager_state), (lazy_param, lazy_state) in zip(zip(*runs[True]), zip(*runs[False])):
        assert torch.equal(eager_param, lazy_param)
        assert eager_state.keys() == lazy_state.keys()
        for key in lazy_state:
            assert (eager_state[key].dtype, eager_state[key].device) == (lazy_state[key].dtype, lazy_state[key].device), key
            assert torch.equal(eager_state[key], lazy_state[key]), key


def test_the_trainer_holds_its_adam_states_before_its_first_step(megatron_rank, tiny_model):
    actor = actor_of(tiny_model)
    for part in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for group in part.optimizer.param_groups:
            for param in group["params"]:
                state = part.optimizer.state[param]
                assert state["exp_avg"].shape == param.shape and not state["exp_avg_sq"].any() and state["step"] == 0


@pytest.mark.parametrize("gemm, pieces", [
    ("torch", None), ("torch", ((99, "flash"), (511, "kept"), (None, "blocked"))),
    pytest.param("onednn", None, marks=pytest.mark.skipif(not cpu_gemm.onednn_available(),
                                                          reason="torch built without oneDNN"))])
def test_packed_attention_by_scaled_dot_product_equals_the_local_attention(megatron_rank, monkeypatch, gemm, pieces):
    """Megatron's local attention per sequence (the reference) and megarl's packed attention per sequence,
    on a packed row of unequal sequences with grouped heads: outputs and input gradients. With the library's
    default pieces (attention_paths.DEFAULT_PATHS) torch's GEMMs take the flash kernel throughout and
    oneDNN's the short path at 104 tokens, the blocks at 520; measured pieces for torch's GEMMs here put 104
    tokens through the kept blocks and 520 through the recomputed ones (the calls are counted)."""
    from megarl.models import attention_paths
    from megarl.models import causal_attention as attention_module
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.models.attention import PackedDotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    attention = PackedDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                          attention_type="self")
    lengths = [7, 1, 104, 12, 520]
    calls = []
    for function in (attention_module._ShortCausalAttention, attention_module._BlockedCausalAttention):
        monkeypatch.setattr(function, "apply", lambda *args, function=function, original=function.apply:
                            calls.append((function.__name__, args[0].shape[0], *args[5:])) or original(*args))
    monkeypatch.setattr(cpu_gemm, "_state", {"onednn": False})  # the process's own state again after the test
    # the default pieces whatever this machine measured, or the given ones
    monkeypatch.setattr(attention_paths, "_measured", {} if pieces is None else {(gemm, 4, 2, 16): pieces})
    cpu_gemm.use(gemm)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(sum(lengths), heads, 16, generator=generator, requires_grad=True) for heads in (4, 2, 2)]
    upstream = torch.randn(sum(lengths), 1, 64, generator=generator)
    results = {}
    for fused in (True, False):
        attention._fused_attention_applies = lambda attn_mask_type, fused=fused: fused
        output = attention(*inputs, None, packed_seq_params=packed)
        output.backward(upstream)
        results[fused] = [output.detach()] + [tensor.grad.clone() for tensor in inputs]
        for tensor in inputs:
            tensor.grad = None
    assert results[True][0].shape == (sum(lengths), 1, 64)
    # (the function, the sequence's length, and for the blocks whether they keep their probabilities)
    assert calls == ([("_ShortCausalAttention", 104), ("_BlockedCausalAttention", 520, False)] if gemm == "onednn"
                     else [("_BlockedCausalAttention", 104, True), ("_BlockedCausalAttention", 520, False)] if pieces
                     else [])
    for name, fused, local in zip(("output", "query grad", "key grad", "value grad"), results[True], results[False]):
        assert_fp32_paths_agree(fused, local, name)
    # and the real check picks the fused path for this module (causal, vanilla softmax, no dropout)
    del attention._fused_attention_applies
    assert attention._fused_attention_applies(None)


def _short_cases():
    from megarl.models.causal_attention import _ShortCausalAttention
    from megarl.models.attention_paths import SHORT_MAX_TOKENS

    # any length up to the longest the short path may take (measured pieces may give it the shortest; at 1
    # token the query's gradient is exactly 0 and both paths' rounding noise has no scale to compare against)
    return [(length, lambda q, k, v: _ShortCausalAttention.apply(q, k, v, 0.3))
            for length in (2, 64, 173, SHORT_MAX_TOKENS)]


def _blocked_cases():
    from megarl.models.causal_attention import ATTENTION_BLOCK, _BlockedCausalAttention

    # each library's block size: whole blocks and a last block that is partial; many small blocks with a
    # partial last one; one block longer than the sequence; each with the probabilities recomputed and kept
    return [(length, lambda q, k, v, block=block, keep=keep: _BlockedCausalAttention.apply(q, k, v, 0.3, block, keep))
            for keep in (False, True) for block in sorted(set(ATTENTION_BLOCK.values()))
            for length in (4 * block, 300, 20, 2)] + [
        (50, lambda q, k, v, keep=keep: _BlockedCausalAttention.apply(q, k, v, 0.3, 16, keep))
        for keep in (False, True)]


@pytest.mark.parametrize("gemm", ["torch", pytest.param("onednn", marks=pytest.mark.skipif(
    not cpu_gemm.onednn_available(), reason="torch built without oneDNN"))])
@pytest.mark.parametrize("heads, groups", [(8, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("cases", [_short_cases, _blocked_cases], ids=["short", "blocked"])
def test_megarls_attention_equals_the_flash_kernel_in_value_and_gradients(heads, groups, cases, gemm, monkeypatch):
    """megarl's causal attention through either GEMM library, for short sequences (the softmax kept) and long
    ones (blocks of query rows, the probabilities recomputed from the log-sum-exp or kept), against torch's
    scaled_dot_product_attention, at lengths across the range each may be used for (attention_paths)."""
    generator = torch.Generator().manual_seed(heads + groups)
    monkeypatch.setattr(cpu_gemm, "_state", {"onednn": False})  # the process's own state again after the test
    cpu_gemm.use(gemm)
    for length, attention in cases():
        inputs = [torch.randn(length, h, 32, generator=generator) for h in (heads, groups, groups)]
        upstream = torch.randn(length, heads, 32, generator=generator)

        def flash(q, k, v):
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], is_causal=True, scale=0.3,
                                                  enable_gqa=groups < heads)[0].transpose(0, 1)

        reference = forward_and_grads(flash, inputs, upstream)
        ours = forward_and_grads(attention, inputs, upstream)
        for what, a, b in zip(("output", "query grad", "key grad", "value grad"), ours, reference):
            assert_fp32_paths_agree(a, b, f"{what}, {length} tokens, {heads} heads in {groups} groups")


def test_the_kept_blocks_recompute_no_scores_in_the_backward(monkeypatch):
    """The kept path's backward multiplies no block's scores again (the recomputing path's does, once per
    block); under no_grad (logprobs, where the path keeps nothing) its output is the same."""
    from megarl.models import causal_attention as attention_module

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(300, 4, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(300, 2, 8, generator=generator, requires_grad=True) for _ in range(2))
    calls, original = [], attention_module._block_scores
    monkeypatch.setattr(attention_module, "_block_scores", lambda *args: calls.append(1) or original(*args))
    blocks = 2 * -(-300 // 32)  # groups x blocks of 32 positions
    for keep, recomputed in ((False, blocks), (True, 0)):
        calls.clear()
        output = attention_module._BlockedCausalAttention.apply(query, key, value, 0.3, 32, keep)
        assert len(calls) == blocks
        output.sum().backward()
        assert len(calls) - blocks == recomputed, keep
        if keep:
            with torch.no_grad():
                assert torch.equal(attention_module._BlockedCausalAttention.apply(query, key, value, 0.3, 32, True),
                                   output.detach())


def forward_and_grads(function, inputs, upstream):
    """function(*inputs) and the gradients of <output, upstream> with respect to each input."""
    inputs = [tensor.detach().clone().requires_grad_(True) for tensor in inputs]
    output = function(*inputs)
    output.backward(upstream)
    return [output.detach()] + [tensor.grad for tensor in inputs]


def test_rms_norm_equals_torchs_in_value_and_gradients():
    from megarl.models.elementwise import RMSNorm

    generator = torch.Generator().manual_seed(0)
    for shape in ((37, 2, 48), (37, 4, 16)):  # a layer norm's [s, b, H]; a q/k norm's [s, heads, head_dim]
        ours, torchs = RMSNorm(shape[-1], eps=1e-6), torch.nn.RMSNorm(shape[-1], eps=1e-6)
        weight = torch.randn(shape[-1], generator=generator) + 1.0
        x, upstream = torch.randn(shape, generator=generator) * 3, torch.randn(shape, generator=generator)
        with torch.no_grad():
            ours.weight.copy_(weight)
            torchs.weight.copy_(weight)
        results = {}
        for name, norm in (("ours", ours), ("torch", torchs)):
            norm.weight.grad = None
            out = forward_and_grads(norm, [x], upstream)
            results[name] = out + [norm.weight.grad]
        for what, a, b in zip(("output", "input grad", "weight grad"), results["ours"], results["torch"]):
            assert_fp32_paths_agree(a, b, f"{what} {shape}")
    assert ours.state_dict().keys() == torchs.state_dict().keys()


def test_rotary_embedding_equals_megatrons_in_value_and_gradients(megatron_rank):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megarl.models import elementwise

    elementwise.install()
    ours = rope_utils._apply_rotary_pos_emb_bshd
    megatrons = ours.megarl_original
    freqs = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)(37)  # [s, 1, 1, 16]
    generator = torch.Generator().manual_seed(0)
    t, upstream = torch.randn(37, 2, 4, 16, generator=generator), torch.randn(37, 2, 4, 16, generator=generator)
    for kwargs in ({}, {"mscale": 0.7}):
        for what, a, b in zip(("output", "grad"), forward_and_grads(lambda x: ours(x, freqs, **kwargs), [t], upstream),
                              forward_and_grads(lambda x: megatrons(x, freqs, **kwargs), [t], upstream)):
            assert_fp32_paths_agree(a, b, f"rotary {what} {kwargs}")
    # the interleaved layout is Megatron's own path, unchanged
    assert torch.equal(ours(t, freqs, rotary_interleaved=True), megatrons(t, freqs, rotary_interleaved=True))


def test_cpu_gradient_accumulation_fusion_sums_micro_batches_as_the_unfused_path(megatron_rank, tiny_model,
                                                                                 monkeypatch):
    """The trained model's linear layers add their weight gradients into DDP's main_grad in the GEMM
    (accelerator._CpuWeightGradientAccumulation); over two micro-batches the main gradients are the
    unfused path's (a gradient per micro-batch, added by DDP's hook)."""
    from megarl import actor as actor_module
    from megarl.model_runner import forward_backward

    fused = actor_of(tiny_model)
    assert fused.model.config.gradient_accumulation_fusion
    overrides = actor_module.trainer_config_overrides
    monkeypatch.setattr(actor_module, "trainer_config_overrides",
                        lambda args: dict(overrides(args), gradient_accumulation_fusion=False))
    unfused = actor_of(tiny_model)
    assert not unfused.model.config.gradient_accumulation_fusion
    grads = {}
    for name, actor in (("fused", fused), ("unfused", unfused)):
        actor.model.train()
        actor.model.zero_grad_buffer()
        forward_backward(actor.model, micro_batches(count=2, seed=2), nll, False, 2)
        grads[name] = {key: param.main_grad.clone() for key, param in actor.model.named_parameters()}
    assert any(grad.abs().max() > 0 for grad in grads["fused"].values())
    for key, grad in grads["fused"].items():
        assert_fp32_paths_agree(grad, grads["unfused"][key], key)


def test_residual_add_without_dropout_is_megatrons_sum():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from megarl.models.elementwise import bias_dropout_add

    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 1, 8, generator=generator), torch.randn(5, 1, 8, generator=generator)
    for training in (True, False):
        assert torch.equal(bias_dropout_add(training, False)((x, None), residual, 0.0),
                           get_bias_dropout_add(training, False)((x, None), residual, 0.0))
    bias = torch.randn(8, generator=generator)  # with a bias (or dropout) it is Megatron's own
    assert torch.equal(bias_dropout_add(True, False)((x, bias), residual, 0.0),
                       get_bias_dropout_add(True, False)((x, bias), residual, 0.0))
    torch.manual_seed(3)
    dropped = bias_dropout_add(True, False)((x, None), residual, 0.5)
    torch.manual_seed(3)
    assert torch.equal(dropped, get_bias_dropout_add(True, False)((x, None), residual, 0.5))


def test_swiglu_equals_megatrons_gated_unit_and_is_the_dense_mlps_activation(megatron_rank, tiny_model):
    import torch.nn.functional as F
    from transformers import AutoConfig

    from megarl.models.elementwise import SwiGLU
    from megarl.models.megatron_gpt import build_gpt_model

    def megatrons(y):  # transformer/mlp.py's glu with glu_linear_offset 0
        gate, up = torch.chunk(y, 2, dim=-1)
        return F.silu(gate) * (up + 0.0)

    generator = torch.Generator().manual_seed(0)
    y, upstream = torch.randn(9, 2, 24, generator=generator) * 3, torch.randn(9, 2, 12, generator=generator)
    for what, a, b in zip(("output", "grad"), forward_and_grads(SwiGLU(), [y], upstream),
                          forward_and_grads(megatrons, [y], upstream)):
        assert_fp32_paths_agree(a, b, f"swiglu {what}")
    model = build_gpt_model(AutoConfig.from_pretrained(tiny_model))
    assert all(isinstance(layer.mlp.activation_func, SwiGLU) for layer in model.decoder.layers)
    # and the model still checkpoints: Megatron's MLP asks every child for its sharded state
    assert {key.split(".mlp.")[1] for key in model.sharded_state_dict() if ".mlp." in key} == \
        {"linear_fc1.weight", "linear_fc2.weight", "linear_fc1._extra_state", "linear_fc2._extra_state"}


def _nll_through_kernels(actor, hidden: bool):
    """helpers.nll's loss through the loss kernels: the chunked ones from the final hidden states and the output
    weight (its gradient added into main_grad by the kernel), or the naive one from the logits (the output
    layer's own backward)."""
    from megarl import kernels
    from megarl.model_runner import output_weight

    def loss(batch, output, companion_outputs):
        vocab = actor.hf_config.vocab_size
        logprobs = (kernels.token_logprobs(output, batch.labels, vocab, 1.0, "chunked",
                                           weight_shard=output_weight(actor.model)) if hidden
                    else kernels.token_logprobs(output, batch.labels, vocab, 1.0, "naive"))
        total = -(logprobs * batch.loss_mask).sum()
        return total, batch.loss_mask.sum().to(torch.int), {"sums": {"loss": total.detach()}}

    return loss


@pytest.mark.parametrize("model", ["tiny_model", "random_qwen2_untied"], ids=["tied", "untied"])
def test_the_kernels_output_weight_gradient_reaches_main_grad_once(megatron_rank, model, request):
    """Under Megatron's DDP the fused kernels add the output weight's gradient into its main_grad themselves and
    hand autograd a placeholder marked grad_added_to_main_grad: every main_grad equals the one from the logits'
    path (the output layer's backward), within fp32 rounding. Added a second time by DDP's hook, the output
    weight's would be twice it; a tied weight's (the embedding's) also holds the lookup's gradient, which
    the hook still adds (zero_out_wgrad)."""
    from megarl.model_runner import forward_backward

    actor = actor_of(request.getfixturevalue(model))
    grads = {}
    for hidden in (False, True):
        actor.model.train()
        actor.model.zero_grad_buffer()
        forward_backward(actor.model, micro_batches(count=2, seed=2), _nll_through_kernels(actor, hidden), False, 2,
                         hidden=hidden)
        grads[hidden] = {key: param.main_grad.clone() for key, param in actor.model.named_parameters()}
    assert any("output_layer" in key or "word_embeddings" in key for key in grads[True])
    for key, grad in grads[True].items():
        assert grad.abs().max() > 0, key
        assert_fp32_paths_agree(grad, grads[False][key], key)


def test_a_packed_rows_layers_cut_it_by_its_host_bounds_and_give_the_same_logits(megatron_rank, tiny_model):
    """accelerator.packed_sequence_params hands every layer the row's boundaries as Python ints once per
    micro-batch: with its cu_seqlens moved to the meta device (any read of them back to the host raises, as a
    per-layer .tolist() or .item() would), the model's logits on a packed row are bit for bit those of the
    same row whose boundaries are read from its tensors (Megatron's own THD RoPE and the attention's reads),
    and each sequence's logits are those of the sequence alone, within two fp32 paths' rule."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl import accelerator

    model = actor_of(tiny_model).model
    model.eval()
    lengths = [9, 1, 23, 14]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 250, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    host = accelerator.packed_sequence_params(lengths)
    meta = torch.empty(len(lengths) + 1, dtype=torch.int32, device="meta")
    meta.megarl_bounds = host.cu_seqlens_q.megarl_bounds
    host.cu_seqlens_q = host.cu_seqlens_kv = host.cu_seqlens_q_padded = host.cu_seqlens_kv_padded = meta
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                            cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
                            max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    with torch.no_grad():
        packed = model(tokens, positions, attention_mask=None, packed_seq_params=host)
        read_back = model(tokens, positions, attention_mask=None, packed_seq_params=plain)
        alone = torch.cat([model(piece, torch.arange(piece.shape[1])[None], attention_mask=None)[0]
                           for piece in tokens.split(lengths, dim=1)])
    assert torch.equal(packed, read_back)
    assert_fp32_paths_agree(packed[0], alone, "packed vs each sequence alone")


def _hf_sliding_window_attention(query, key, value, window, scale):
    """transformers' eager attention (Qwen2's eager_attention_forward) of one sequence under its own sliding-window
    causal mask (masking_utils: causal_mask_function and sliding_window_overlay), in the dtype of the inputs:
    query [s, heads, dim], key and value [s, groups, dim] -> [s, heads, dim]."""
    from types import SimpleNamespace

    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    visible = and_masks(causal_mask_function, sliding_window_overlay(window))
    allowed = visible(0, 0, torch.arange(query.shape[0])[:, None], torch.arange(key.shape[0])[None, :])  # [q, k]
    bias = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill_(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1], training=False)
    output, _ = eager_attention_forward(module, query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                        value.transpose(0, 1)[None], bias[None, None], scale)
    return output[0]  # [s, heads, dim]


def test_sliding_window_layers_attend_as_transformers_on_every_path(megatron_rank, monkeypatch):
    """A sliding-window layer (Megatron's window_size / window_attn_skip_freq as megatron_gpt.window_config sets
    them) in megarl's core attention against transformers' eager attention under its sliding-window mask in float64:
    a padded batch (Megatron's local attention, its softmax's windowed mask built on the host:
    accelerator.apply_megatron_shims), a packed row of unequal sequences (per sequence the local attention, not
    torch's kernel nor megarl's GEMM paths, which have no window), and each rank's two chunks under context
    parallelism 2 (the window folded into the explicit mask); outputs and the inputs' gradients within the fp32
    rule. The model's other layer (window_attn_skip_freq 0) keeps full causal attention and the fast paths."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from helpers import fp32_limit, ulps
    from megarl import context_parallel
    from megarl.models.attention import PackedDotProductAttention

    window, heads, groups, dim = 5, 4, 2, 16
    config = TransformerConfig(num_layers=2, hidden_size=heads * dim, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=0.0, hidden_dropout=0.0,
                               use_cpu_initialization=True, window_size=(window - 1, 0), window_attn_skip_freq=[1, 0])
    windowed, full = (PackedDotProductAttention(config, layer_number=layer, attn_mask_type=AttnMaskType.causal,
                                                attention_type="self") for layer in (1, 2))
    assert windowed.window_size == (window - 1, 0) and not windowed._fused_attention_applies(None)
    assert full.window_size is None and full._fused_attention_applies(None)
    scale = windowed.softmax_scale
    generator = torch.Generator().manual_seed(0)

    def check(run, sequences, what):
        """run(q, k, v) -> [t, heads * dim] for the sequences laid end to end, against the reference per sequence."""
        inputs = [torch.cat([torch.randn(s, h, dim, generator=generator, dtype=torch.float64) for s in sequences])
                  for h in (heads, groups, groups)]
        upstream = torch.randn(sum(sequences), heads * dim, generator=generator, dtype=torch.float64)

        def reference(q, k, v):
            return torch.cat([_hf_sliding_window_attention(*parts, window, scale)
                              for parts in zip(q.split(sequences), k.split(sequences), v.split(sequences))]
                             ).reshape(sum(sequences), -1)

        expected = forward_and_grads(reference, inputs, upstream)
        ours = forward_and_grads(lambda q, k, v: run(q, k, v).reshape(sum(sequences), -1),
                                 [x.float() for x in inputs], upstream.float())
        measured = {name: ulps(a, b) for name, a, b in zip(("output", "query grad", "key grad", "value grad"),
                                                          ours, expected)}
        print(f"sliding window, {what}: ulps {measured}")
        assert max(measured.values()) <= fp32_limit(), (what, measured)
        if len(sequences) == 1:  # the window matters here: full causal attention is far from it
            full_causal = F.scaled_dot_product_attention(
                *(x.repeat_interleave(heads // x.shape[1], 1).transpose(0, 1)[None] for x in inputs),
                is_causal=True, scale=scale)[0].transpose(0, 1).reshape(sum(sequences), -1)
            assert ulps(full_causal, expected[0]) > 100 * fp32_limit()

    # padded: two rows of 23 tokens ([s, b, heads, dim]), Megatron's local attention with its windowed mask
    def padded(q, k, v):
        rows = [x.reshape(2, 23, *x.shape[1:]).transpose(0, 1) for x in (q, k, v)]
        return windowed(*rows, None).transpose(0, 1)  # [s, b, heads * dim] -> [b, s, ...]

    check(padded, [23, 23], "padded")
    # one sequence alone also shows the window moves the result
    check(lambda q, k, v: windowed(q[:, None], k[:, None], v[:, None], None), [31], "one sequence")

    lengths = [7, 1, 30, 12]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    check(lambda q, k, v: windowed(q, k, v, None, packed_seq_params=packed), lengths, "packed")

    # context parallelism 2: each rank's queries are chunks 0 and 3 (rank 0) or 1 and 2 (rank 1) of each slot's
    # 4; the keys and values gathered over the CP group are the whole slots' (the gather stood in for here)
    cp, slots = 2, [16, 24]
    slot_bounds = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()], dtype=torch.int32)
    cp_packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=slot_bounds, cu_seqlens_kv=slot_bounds,
                                max_seqlen_q=max(slots), max_seqlen_kv=max(slots), cu_seqlens_q_padded=slot_bounds,
                                cu_seqlens_kv_padded=slot_bounds)
    monkeypatch.setattr(config, "context_parallel_size", cp)
    for rank in range(cp):
        places = context_parallel.local_positions(slots, cp, rank)
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda rank=rank: rank)
        generator.manual_seed(rank)
        query, key, value = (torch.cat([torch.randn(s, h, dim, generator=generator, dtype=torch.float64)
                                        for s in slots]) for h in (heads, groups, groups))
        gathered = [key.float(), value.float()]
        monkeypatch.setattr(context_parallel, "gather", lambda local, slots, dim=0: gathered.pop(0))
        ours = windowed(query.float()[places], key.float()[places], value.float()[places], None,
                        packed_seq_params=cp_packed)[:, 0]
        expected = torch.cat([_hf_sliding_window_attention(*parts, window, scale) for parts in
                              zip(query.split(slots), key.split(slots), value.split(slots))]
                             ).reshape(sum(slots), -1)[places]
        print(f"sliding window, CP rank {rank}: output ulps {ulps(ours, expected):.1f}")
        assert ulps(ours, expected) <= fp32_limit(), f"CP rank {rank}: {ulps(ours, expected):.0f} ulps"
    assert windowed.scale_mask_softmax.window_size == (window - 1, 0)  # put back after each CP forward
