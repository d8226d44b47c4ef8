"""Triton store_kv against kvpager_kernels.reference.store_kv."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpager_kernels as kernels
from executor_service.kv_pool import head_major
from kvpager_kernels import reference as R


def _pool(dtype, device, num_blocks=6, block_size=8, kv_heads=2, head_dim=16, layers=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, 2, num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _check(pool, key, value, slots, layer=1):
    expect = pool.clone()
    R.store_kv(key, value, expect[layer, 0], expect[layer, 1], slots)
    kernels.store_kv(key, value, pool[layer, 0], pool[layer, 1], slots)
    # A pure copy: must be bit exact, and other layers untouched.
    assert torch.equal(pool, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 256])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_reference(device, dtype, head_dim, slot_dtype):
    pool = _pool(dtype, device, head_dim=head_dim)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(6, 2, head_dim, generator=gen).to(device=device, dtype=dtype)
    value = torch.randn(6, 2, head_dim, generator=gen).to(device=device, dtype=dtype)
    slots = torch.tensor([47, -1, 0, 13, -7, 30], dtype=slot_dtype, device=device)
    _check(pool, key, value, slots)


def test_store_kv_strided_inputs(device):
    # key/value as slices of a fused [T, 3, KVH, D] qkv-like tensor.
    pool = _pool(torch.float32, device)
    fused = torch.randn(5, 3, 2, 16).to(device)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.tensor([3, 9, -1, 40, 17], device=device)
    _check(pool, key, value, slots)


def test_store_kv_into_a_head_major_pool(device):
    # The executor's storage (executor_service.kv_pool): [.., KVH, BS, D] in
    # memory under the [.., BS, KVH, D] shape; the reference writes through
    # index_put_ there, the kernel by strides.
    pool = head_major((2, 2, 6, 8, 2, 16), device=device).copy_(_pool(torch.float32, device))
    assert pool[1, 0].stride()[1:] == (16, 8 * 16, 1)
    key, value = torch.randn(2, 5, 2, 16).to(device)
    _check(pool, key, value, torch.tensor([3, 9, -1, 40, 17], device=device))


def test_store_kv_all_skipped_and_empty(device):
    pool = _pool(torch.float16, device)
    before = pool.clone()
    key = torch.randn(3, 2, 16).to(device=device, dtype=torch.float16)
    kernels.store_kv(key, key, pool[0, 0], pool[0, 1], torch.full((3,), -1, device=device))
    empty = key[:0]
    kernels.store_kv(empty, empty, pool[0, 0], pool[0, 1], torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(pool, before)


def test_store_kv_rejects_bad_args(device):
    pool = _pool(torch.float32, device)
    key = torch.randn(2, 2, 16, device=device)
    with pytest.raises(AssertionError):
        kernels.store_kv(key.half(), key.half(), pool[0, 0], pool[0, 1], torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(AssertionError):
        kernels.store_kv(key, key, pool[0, 0], pool[0, 1], torch.zeros(3, dtype=torch.int64, device=device))


@settings(max_examples=10, deadline=None)
@given(
    num_tokens=st.integers(1, 12),
    block_size=st.sampled_from([8, 16, 32]),
    kv_heads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_store_kv_hypothesis(device, num_tokens, block_size, kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 4
    pool = _pool(torch.float32, device, num_blocks=num_blocks, block_size=block_size, kv_heads=kv_heads, seed=seed)
    # Distinct slots (a scatter with duplicate slots has no defined winner),
    # about a quarter of them skipped.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    key = torch.randn(num_tokens, kv_heads, 16, generator=gen).to(device)
    value = torch.randn(num_tokens, kv_heads, 16, generator=gen).to(device)
    _check(pool, key, value, slots.to(device), layer=0)
