"""Pure-torch references of the fused layer kernels (``kvpager_kernels/cpu/fused.cpp``),
same signatures. These are transformers' Llama ops as written there, so the
executor's own model computes exactly what transformers computes when it
runs them (the ``torch`` backend, CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpager_kernels import reference

__all__ = ["rms_norm", "add_rms_norm", "rope", "rope_store_kv", "silu_mul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32, cast back, then scale. x: [R, N]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place), then rms_norm(residual)."""
    residual.add_(delta)
    return rms_norm(residual, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
         num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (H + 2 KVH) * D]; cos, sin: [T, D] -> q [T, H, D], k [T, KVH, D]
    rotated, v [T, KVH, D]."""
    t, d = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split((num_heads * d, num_kv_heads * d, num_kv_heads * d), dim=-1)
    q, k, v = q.view(t, num_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]: broadcast over heads
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """rope, then the rotated k and v into the caches at slot_mapping
    (negative = skip); returns q [T, H, D]."""
    q, k, v = rope(qkv, cos, sin, num_heads, num_kv_heads)
    reference.store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
