"""Triton kernel: copy whole KV blocks (copy-on-write), many pairs per launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpager_kernels.checks import check_cache_pair, check_float_dtype, check_index

__all__ = ["copy_blocks", "copy_blocks_all_layers"]

# Elements moved per program: big enough to saturate memory with few
# programs, small enough to keep the index math in registers.
_CHUNK = 1024


@triton.jit
def _copy_blocks_kernel(
    k_ptr, v_ptr, src_ptr, dst_ptr,
    stride_k_outer, stride_k_b, stride_k_t, stride_k_h, stride_k_d,
    stride_v_outer, stride_v_b, stride_v_t, stride_v_h, stride_v_d,
    num_kv_heads, head_dim, block_elems,
    CHUNK: tl.constexpr,
):
    # grid: (pairs, outer, chunks). "outer" is the layer index for the
    # all-layers variant (1 for a single layer's caches); each program copies
    # one CHUNK of one block in both K and V.
    pair = tl.program_id(0).to(tl.int64)
    outer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2).to(tl.int64)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)

    # Flat element index inside the block -> (token, head, dim), so that any
    # strides (per-layer views of the pool) are honoured.
    e = chunk * CHUNK + tl.arange(0, CHUNK).to(tl.int64)  # [CHUNK]
    mask = e < block_elems
    d = e % head_dim
    h = (e // head_dim) % num_kv_heads
    t = e // (head_dim * num_kv_heads)

    k_inner = outer * stride_k_outer + t * stride_k_t + h * stride_k_h + d * stride_k_d
    v_inner = outer * stride_v_outer + t * stride_v_t + h * stride_v_h + d * stride_v_d
    k = tl.load(k_ptr + src * stride_k_b + k_inner, mask=mask)
    v = tl.load(v_ptr + src * stride_v_b + v_inner, mask=mask)
    tl.store(k_ptr + dst * stride_k_b + k_inner, k, mask=mask)
    tl.store(v_ptr + dst * stride_v_b + v_inner, v, mask=mask)


def _check_pairs(src: torch.Tensor, dst: torch.Tensor, device: torch.device) -> None:
    check_index(src, "src", device)
    check_index(dst, "dst", device, shape=src.shape)
    assert src.dim() == 1, f"src/dst must be 1-D, got {tuple(src.shape)}"


def _launch(k, v, src, dst, num_outer, k_outer_stride, v_outer_stride) -> None:
    # k, v: [NB, BS, KVH, D] views (the outer/layer dim is carried by strides)
    _, block_size, num_kv_heads, head_dim = k.shape
    block_elems = block_size * num_kv_heads * head_dim
    grid = (src.shape[0], num_outer, triton.cdiv(block_elems, _CHUNK))
    _copy_blocks_kernel[grid](
        k, v, src.contiguous(), dst.contiguous(),
        k_outer_stride, *k.stride(), v_outer_stride, *v.stride(),
        num_kv_heads, head_dim, block_elems,
        CHUNK=_CHUNK,
    )


def copy_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy block src[i] -> dst[i] in both caches ([NB, BS, KVH, D]).

    src, dst: [P] int32/int64. Programs run in parallel, so dst ids must be
    distinct and disjoint from src ids (true for copy-on-write, where dst
    blocks are freshly allocated).
    """
    check_cache_pair(k_cache, v_cache)
    _check_pairs(src, dst, k_cache.device)
    if src.shape[0] == 0:
        return
    _launch(k_cache, v_cache, src, dst, 1, 0, 0)


def copy_blocks_all_layers(kv_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """copy_blocks over every layer, K and V, of the pool in one launch.

    kv_pool: [L, 2, NB, BS, KVH, D]; src, dst: [P] int32/int64 (same
    constraints as copy_blocks).
    """
    assert kv_pool.dim() == 6 and kv_pool.shape[1] == 2, (
        f"kv_pool must be [L, 2, NB, BS, KVH, D], got {tuple(kv_pool.shape)}"
    )
    check_float_dtype(kv_pool, "kv_pool")
    _check_pairs(src, dst, kv_pool.device)
    if src.shape[0] == 0 or kv_pool.shape[0] == 0:
        return
    k, v = kv_pool[0, 0], kv_pool[0, 1]  # [NB, BS, KVH, D] views of layer 0
    layer_stride = kv_pool.stride(0)
    _launch(k, v, src, dst, kv_pool.shape[0], layer_stride, layer_stride)
