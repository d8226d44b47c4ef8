"""Triton paged_attention against kvpager_kernels.reference (and, once, against the
independent contiguous SDPA computation).

Interpreter cost is roughly per KV-tile iteration, so contexts stay < ~150
tokens; the KV tile is 64 tokens (32 for head_dim 256), so block sizes 8/16
exercise tiles spanning several blocks and 32/128 whole-block tiles.
"""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpager_kernels as kernels
from executor_service.kv_pool import head_major
from kvpager_kernels import reference as R
from kvpager_kernels.testing import contiguous_attention, make_paged_batch
from kvpager_kernels.triton_paged_attention import decode_partition_size, paged_attention_impl

MIXES = {
    # name: (seq_lens, q_lens)
    "prefill": ([37], [37]),
    "prefix_hit": ([150, 20], [13, 20]),  # chunk after cached context; crosses tiles
    "mixed": ([5, 70, 9, 33], [5, 1, 3, 1]),
    "decode": ([1, 70, 9, 130], [1, 1, 1, 1]),
}


def _batch(mix, device, **kw):
    seq_lens, q_lens = MIXES[mix]
    params = dict(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    params.update(kw)
    return make_paged_batch(seq_lens, q_lens, device=device, **params)


def _assert_matches_reference(batch, tol, got=None, **impl_kw):
    if got is None:
        got = paged_attention_impl(*batch.args(), **impl_kw)
    want = R.paged_attention(*batch.args())
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    torch.testing.assert_close(got.float(), want.float(), **tol(batch.q.dtype))


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_attention_mixes_gqa_blocks(device, tol, mix, group, block_size):
    batch = _batch(mix, device, num_heads=2 * group, num_kv_heads=2, block_size=block_size)
    _assert_matches_reference(batch, tol, got=kernels.paged_attention(*batch.args()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_attention_dtypes_head_dims(device, tol, dtype, head_dim):
    batch = _batch("mixed", device, dtype=dtype, head_dim=head_dim)
    _assert_matches_reference(batch, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [64, 128])
def test_decode_split_partitions(device, tol, dtype, partition_size):
    # 130 tokens over 64-token partitions: 3 partitions with a ragged last one;
    # the 1-token sequence leaves most partitions empty.
    batch = _batch("decode", device, dtype=dtype, block_size=8, extra_table_cols=4)
    _assert_matches_reference(batch, tol, split_decode=True, partition_size=partition_size)


def test_decode_without_split(device, tol):
    batch = _batch("decode", device, num_heads=8, block_size=32)
    _assert_matches_reference(batch, tol, split_decode=False)


@pytest.mark.parametrize("mix", ["decode", "prefix_hit"])
def test_head_major_pool_gives_the_same_bits(device, mix):
    # The executor stores each block head-major (executor_service.kv_pool).
    batch = _batch(mix, device, num_heads=8)
    pool = head_major(batch.pool.shape, dtype=batch.pool.dtype, device=batch.pool.device).copy_(batch.pool)
    hm = dataclasses.replace(batch, pool=pool)
    assert hm.k_cache.stride() != batch.k_cache.stride()
    assert torch.equal(kernels.paged_attention(*hm.args()), kernels.paged_attention(*batch.args()))


def test_block_size_128_and_gqa_8(device, tol):
    batch = make_paged_batch([200, 3], [1, 3], num_heads=8, num_kv_heads=1, head_dim=64,
                             block_size=128, device=device)
    _assert_matches_reference(batch, tol)


@pytest.mark.parametrize("mix", ["mixed", "decode"])
def test_non_power_of_two_group(device, tol, mix):
    # 3 query heads per kv head: rows padded to 4 per token, the 4th masked.
    batch = _batch(mix, device, num_heads=12, num_kv_heads=4, head_dim=80, block_size=8)
    _assert_matches_reference(batch, tol)


def test_matches_independent_sdpa(device):
    batch = _batch("mixed", device, head_dim=80)
    got = kernels.paged_attention(*batch.args())
    torch.testing.assert_close(got.float().cpu(), contiguous_attention(batch).cpu(), atol=2e-5, rtol=2e-5)


def test_out_param_and_strided_q(device, tol):
    # q as a slice of a fused [T, (H + 2 KVH), D] projection: non-contiguous.
    batch = _batch("mixed", device)
    fused = torch.randn(batch.q.shape[0], 8, 64).to(device)
    batch.q = fused[:, :4]
    out = torch.full_like(batch.q, float("nan"))
    got = kernels.paged_attention(*batch.args(), out=out)
    assert got is out
    _assert_matches_reference(batch, tol, got=got)


def test_rejects_bad_args(device):
    batch = _batch("mixed", device)
    args = list(batch.args())
    with pytest.raises(AssertionError):  # dtype mismatch with the cache
        kernels.paged_attention(args[0].half(), *args[1:])
    with pytest.raises(AssertionError):  # heads not a multiple of kv heads
        kernels.paged_attention(args[0][:, :3], *args[1:])
    with pytest.raises(AssertionError):  # query_start_loc of the wrong length
        kernels.paged_attention(*args[:5], args[5][:-1], args[6])


def test_partition_size_heuristic():
    # batch 1, 16K context, 4 kv heads: ~128 partitions wanted, floor of 4 tiles.
    assert decode_partition_size(1, 4, 16384, 64) == 256
    # big batches: a single partition covering the whole context
    assert decode_partition_size(256, 4, 16384, 64) == 16384
    for args in [(3, 2, 1000, 64), (16, 8, 4096, 32), (1, 1, 1, 64)]:
        size = decode_partition_size(*args)
        assert size % args[3] == 0 and size & (size - 1) == 0


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 90)), min_size=1, max_size=4),
    decode_only=st.booleans(),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([8, 16, 32]),
    head_dim=st.sampled_from([32, 80]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_attention_hypothesis(device, tol, lens, decode_only, group, block_size, head_dim, dtype, seed):
    seq_lens = [max(a, b) for a, b in lens]
    q_lens = [1 if decode_only else min(a, b) for a, b in lens]
    batch = make_paged_batch(seq_lens, q_lens, num_heads=group, num_kv_heads=1, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, seed=seed, device=device)
    # small partitions so split decode really splits
    kw = dict(partition_size=64) if decode_only else {}
    _assert_matches_reference(batch, tol, **kw)
