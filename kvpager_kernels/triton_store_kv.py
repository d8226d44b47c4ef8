"""Triton kernel: scatter new tokens' K/V into the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpager_kernels._jit import next_pow2
from kvpager_kernels.checks import check_cache_pair, check_float_dtype

__all__ = ["store_kv"]


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_key_t, stride_key_h, stride_key_d,
    stride_val_t, stride_val_h, stride_val_d,
    stride_kc_b, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_t, stride_vc_h, stride_vc_d,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    # One program per token; it moves the token's [KVH, D] K and V tiles.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # A skipped token gets zero valid heads. (Folding the scalar condition
    # into the bound, rather than `block_mask & scalar_mask`, because the
    # interpreter turns the latter into an int64 mask that tl.load rejects.)
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    # Clamp so a skipped token's (masked) addresses still stay in bounds.
    slot = tl.maximum(slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    h = tl.arange(0, HEADS_PAD).to(tl.int64)[:, None]  # [HP, 1]
    d = tl.arange(0, DIM_PAD).to(tl.int64)[None, :]  # [1, DP]
    mask = (h < heads) & (d < head_dim)  # [HP, DP]

    k = tl.load(key_ptr + tok * stride_key_t + h * stride_key_h + d * stride_key_d, mask=mask)
    v = tl.load(value_ptr + tok * stride_val_t + h * stride_val_h + d * stride_val_d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_t + h * stride_kc_h + d * stride_kc_d
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_t + h * stride_vc_h + d * stride_vc_d
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, KVH, D]; caches: [NB, BS, KVH, D]; slot_mapping: [T].

    Negative slots are skipped. Writes in place; slots must be distinct.
    """
    check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        check_float_dtype(t, name)
        assert t.dtype == k_cache.dtype, f"{name} dtype {t.dtype} != cache dtype {k_cache.dtype}"
        assert t.device == k_cache.device, f"{name} on {t.device}, cache on {k_cache.device}"
        assert t.dim() == 3 and t.shape[1:] == (num_kv_heads, head_dim), (
            f"{name} must be [T, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}"
        )
    assert key.shape[0] == value.shape[0], "key/value token counts differ"
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0], (
        f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}"
    )
    assert slot_mapping.dtype in (torch.int32, torch.int64), "slot_mapping must be int32/int64"
    assert slot_mapping.device == k_cache.device, "slot_mapping on a different device"
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=next_pow2(num_kv_heads),
        DIM_PAD=next_pow2(head_dim),
    )
