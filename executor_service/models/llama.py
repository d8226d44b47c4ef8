"""Our own forward for Llama-family checkpoints (llama, mistral, qwen2).

Built from the loaded transformers model's config and weights, which it then
no longer needs: q/k/v and gate/up weights are concatenated at load time
(one matmul each instead of three and two), every matmul weight is prepared
for the device (``executor_service.linear``), and activations stay in the
flattened [T, heads, head_dim] layout the paged kernels use, so a layer is
about twenty tensor ops and no layout copies.

The arithmetic follows transformers' Llama code op for op (RMSNorm in fp32
then cast, RoPE cos/sin computed in fp32 from the positions and cast to the
model dtype, residual adds in the model dtype; the CPU attention kernel holds
scores and probabilities in the model dtype as transformers' eager attention
does), so fp32 greedy output matches ``generate`` token for token and bf16
rounds at the same places.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from executor_service.attention import attend, plan_windows
from executor_service.linear import Linear, fused
from executor_service.models import check_stop

if TYPE_CHECKING:
    from executor_service.attention import KernelBackend
    from executor_service.model_runner import ForwardBatch

MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose inverse frequencies are fixed at load time; "dynamic"
# and "longrope" rescale with the sequence length (the transformers path
# serves those).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
# On CPU a step's MLP runs in row blocks of at most this many gate/up
# (intermediate) elements, which bounds the step's largest activation (128 MB
# in bf16). The bound was 6M, when a larger product's output was a fresh mmap
# faulted in on every call (half the speed of four [512, ...] ones); with the
# allocator keeping every block (``cpu_allocator.keep_freed_memory``) one product per
# step is the faster: a 4,544-token prefill of the 0.5B Llama in 2,048-token
# steps, 2.65 -> 2.60 s (bf16) and 12.8 -> 12.6 s (fp32) on the AMX Xeon
# (docs/benchmarks.md). Blocks change no arithmetic: rows are independent.
MLP_BLOCK_ELEMS = 1 << 26


class Unsupported(ValueError):
    """This checkpoint needs the transformers implementation."""


def check_supported(text_config) -> None:
    """Raise ``Unsupported`` unless ``LlamaModel`` reproduces this config exactly."""
    if text_config.model_type not in MODEL_TYPES:
        raise Unsupported(f"model_type {text_config.model_type!r} (own implementation: {MODEL_TYPES})")
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in STATIC_ROPE:
        raise Unsupported(f"rope_type {rope_type!r}")
    if getattr(text_config, "hidden_act", "silu") not in ("silu", "swish"):
        raise Unsupported(f"hidden_act {text_config.hidden_act!r}")
    if getattr(text_config, "pretraining_tp", 1) not in (None, 1):
        raise Unsupported("pretraining_tp > 1")


class Rope:
    """Rotary embedding with fixed inverse frequencies (taken from the
    transformers module, so llama3/yarn/linear scaling come as computed there)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        self.inv_freq = inv_freq.detach().float()  # [D / 2]
        self.scaling = float(attention_scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, D] in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)                      # [T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()


class LayerOps:
    """The elementwise steps of a layer: the C++ fused kernels with the C++
    attention backend (``kvpager_kernels/cpu/fused.cpp``), else their torch
    references (``kvpager_kernels.fused_reference``, transformers' own ops) with the
    backend's store_kv."""

    def __init__(self, backend: KernelBackend) -> None:
        from kvpager_kernels import fused_reference

        self.backend = backend
        self.fused = backend.name == "cpu"
        ops = torch.ops.kvpager_cpu if self.fused else fused_reference
        self.rms_norm, self.add_rms_norm, self.silu_mul = ops.rms_norm, ops.add_rms_norm, ops.silu_mul
        self._rope_store = ops.rope_store_kv if self.fused else None
        self._rope = fused_reference.rope

    def rope_store_kv(self, qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache, slot_mapping):
        if self._rope_store is not None:
            return self._rope_store(qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache, slot_mapping)
        q, k, v = self._rope(qkv, cos, sin, num_heads, num_kv_heads)
        self.backend.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q


class DecoderLayer:
    def __init__(self, layer, index: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 window: int | None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.window = window  # sliding window (None = full attention)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scaling = float(getattr(attn, "scaling", head_dim ** -0.5))
        self.qkv = fused([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                         [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        self.o = Linear(attn.o_proj.weight, attn.o_proj.bias)
        self.gate_up = fused([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias])
        self.down = Linear(mlp.down_proj.weight, mlp.down_proj.bias)
        self.intermediate = mlp.gate_proj.weight.shape[0]
        self.in_norm = layer.input_layernorm.weight.detach()
        self.in_eps = float(layer.input_layernorm.variance_epsilon)
        self.post_norm = layer.post_attention_layernorm.weight.detach()
        self.post_eps = float(layer.post_attention_layernorm.variance_epsilon)

    def forward(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv: tuple[torch.Tensor, torch.Tensor], ops: LayerOps, plans, group: int) -> torch.Tensor:
        """h: [T, hidden] the residual stream (updated in place); x: this
        layer's normalised input; group: its table group. Returns the MLP's output (the caller adds it
        to h with the next norm). Writes this step's K/V into the layer's pool view."""
        t = x.shape[0]
        k_cache, v_cache = kv
        q = ops.rope_store_kv(self.qkv(x), cos, sin, self.num_heads, self.num_kv_heads, k_cache, v_cache,
                              batch.slots_of(group))  # [T, H, D]
        attn = attend(ops.backend, plans, group, self.window, q, k_cache, v_cache, batch.tables_of(group),
                      batch.seq_lens, batch.query_start_loc, self.scaling)
        x = ops.add_rms_norm(self.o(attn.view(t, self.q_size)), h, self.post_norm, self.post_eps)
        return self.mlp(x, ops)

    def mlp(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """SwiGLU: [T, hidden] -> [T, hidden], in row blocks on CPU (``MLP_BLOCK_ELEMS``)."""
        t = x.shape[0]
        blocks = -(-t * 2 * self.intermediate // MLP_BLOCK_ELEMS) if x.device.type == "cpu" else 1
        if blocks <= 1:
            return self.down(ops.silu_mul(self.gate_up(x)))
        rows = -(-t // blocks)
        return torch.cat([self.down(ops.silu_mul(self.gate_up(x[i:i + rows]))) for i in range(0, t, rows)])


class LlamaModel:
    """A loaded Llama-family model; ``forward`` is one flattened paged step."""

    def __init__(self, hf_model, text_config, windows: list[int | None]) -> None:
        check_supported(text_config)
        inner = hf_model.model
        self.dtype = inner.embed_tokens.weight.dtype
        num_heads = text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        self.embed = inner.embed_tokens.weight.detach()  # [V, hidden]
        self.layers = [DecoderLayer(layer, i, num_heads, num_kv_heads, head_dim, windows[i])
                       for i, layer in enumerate(inner.layers)]
        self.windows = windows
        self.norm = inner.norm.weight.detach()
        self.norm_eps = float(inner.norm.variance_epsilon)
        rotary = inner.rotary_emb
        self.rope = Rope(rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0))
        self.lm_head = Linear(hf_model.lm_head.weight, getattr(hf_model.lm_head, "bias", None))
        self._ops: dict[str, LayerOps] = {}  # per attention backend

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                backend: KernelBackend, layer_groups: tuple[int, ...] | None = None) -> torch.Tensor:
        """Writes the batch's K/V into the pool; returns logits [R, V] fp32 for
        ``batch.logits_indices``. layer_groups: each layer's table group
        (None: one table for all)."""
        groups = list(layer_groups) if layer_groups is not None else [0] * len(self.layers)
        plans = plan_windows(backend, self.windows, groups, batch, kv_caches[0][0])
        ops = self._ops.get(backend.name)
        if ops is None:
            ops = self._ops[backend.name] = LayerOps(backend)
        h = F.embedding(batch.input_ids, self.embed)  # [T, hidden]: the residual stream
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        first = self.layers[0]
        x = ops.rms_norm(h, first.in_norm, first.in_eps)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            check_stop(batch.stop, i)
            out = layer.forward(h, x, cos, sin, batch, kv, ops, plans, groups[i])
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1]
                x = ops.add_rms_norm(out, h, nxt.in_norm, nxt.in_eps)
            else:
                h.add_(out)
        # Rows are independent: only the sampled ones need the final norm and the vocab projection.
        h = h.index_select(0, batch.logits_indices)
        return self.lm_head(ops.rms_norm(h, self.norm, self.norm_eps)).float()  # [R, V]
