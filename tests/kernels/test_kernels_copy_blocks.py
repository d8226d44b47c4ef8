"""Triton copy_blocks / copy_blocks_all_layers against the reference."""

import pytest
import torch

import kvpager_kernels as kernels
from executor_service.kv_pool import head_major
from kvpager_kernels import reference as R

PAIRS = ([1, 4, 0], [6, 2, 7])  # dst distinct and disjoint from src


def _pool(dtype, device, head_dim=16, layers=3):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(layers, 2, 8, 8, 2, head_dim, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_copy_blocks_one_layer(device, dtype, index_dtype):
    pool = _pool(dtype, device, head_dim=80)
    expect = pool.clone()
    src, dst = (torch.tensor(x, dtype=index_dtype, device=device) for x in PAIRS)
    kernels.copy_blocks(pool[1, 0], pool[1, 1], src, dst)
    R.copy_blocks(expect[1, 0], expect[1, 1], src, dst)
    assert torch.equal(pool, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", ["token-major", "head-major"])  # head-major: the executor's pool
def test_copy_blocks_all_layers(device, dtype, storage):
    pool = _pool(dtype, device)
    if storage == "head-major":
        pool = head_major(pool.shape, dtype=dtype, device=device).copy_(pool)
    expect = pool.clone()
    src, dst = (torch.tensor(x, device=device) for x in PAIRS)
    kernels.copy_blocks_all_layers(pool, src, dst)
    R.copy_blocks_all_layers(expect, src, dst)
    assert torch.equal(pool, expect)


def test_copy_blocks_non_contiguous_layout(device):
    # Head-major storage viewed as [NB, BS, KVH, D]: strides must be honoured.
    gen = torch.Generator().manual_seed(0)
    k_store = torch.randn(8, 2, 8, 16, generator=gen).to(device)
    v_store = torch.randn(8, 2, 8, 16, generator=gen).to(device)
    k_exp, v_exp = k_store.clone(), v_store.clone()
    src, dst = (torch.tensor(x, device=device) for x in PAIRS)
    kernels.copy_blocks(k_store.transpose(1, 2), v_store.transpose(1, 2), src, dst)
    R.copy_blocks(k_exp.transpose(1, 2), v_exp.transpose(1, 2), src, dst)
    assert torch.equal(k_store, k_exp) and torch.equal(v_store, v_exp)


def test_copy_blocks_no_pairs(device):
    pool = _pool(torch.float32, device)
    before = pool.clone()
    none = torch.empty(0, dtype=torch.int64, device=device)
    kernels.copy_blocks(pool[0, 0], pool[0, 1], none, none)
    kernels.copy_blocks_all_layers(pool, none, none)
    assert torch.equal(pool, before)
