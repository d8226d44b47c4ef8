"""Shared launcher argument checks (shapes, dtypes, devices)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float_dtype(t: torch.Tensor, name: str) -> None:
    assert t.dtype in FLOAT_DTYPES, f"{name}: unsupported dtype {t.dtype}"


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache, v_cache: [NB, BS, KVH, D], same shape/dtype/device.

    Arbitrary strides are allowed (they are usually ``pool[layer, 0/1]``).
    """
    assert k_cache.dim() == 4, f"k_cache must be [NB, BS, KVH, D], got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape, f"cache shapes differ: {k_cache.shape} vs {v_cache.shape}"
    assert k_cache.dtype == v_cache.dtype, "k_cache/v_cache dtypes differ"
    assert k_cache.device == v_cache.device, "k_cache/v_cache devices differ"
    check_float_dtype(k_cache, "k_cache")
    block_size = k_cache.shape[1]
    assert 1 <= block_size <= 1024, f"unsupported block_size {block_size}"


def check_index(t: torch.Tensor, name: str, device: torch.device, shape=None) -> None:
    assert t.dtype in (torch.int32, torch.int64), f"{name} must be int32/int64, got {t.dtype}"
    assert t.device == device, f"{name} on {t.device}, expected {device}"
    if shape is not None:
        assert tuple(t.shape) == tuple(shape), f"{name} must be {tuple(shape)}, got {tuple(t.shape)}"
