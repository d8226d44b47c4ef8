"""kvpager_kernels.reference against independent computations (plain torch only)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpager_kernels import reference as R
from kvpager_kernels.testing import contiguous_attention, make_paged_batch

MIXES = {
    "prefill": ([37], [37]),
    "prefix_hit": ([50, 20], [13, 20]),
    "mixed": ([5, 70, 9, 33], [5, 1, 3, 1]),
    "decode": ([1, 70, 9, 130], [1, 1, 1, 1]),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_attention_matches_sdpa(mix, heads, dtype):
    seq_lens, q_lens = MIXES[mix]
    batch = make_paged_batch(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=32, block_size=8, dtype=dtype)
    got = R.paged_attention(*batch.args())
    assert got.dtype == dtype and got.shape == batch.q.shape
    want = contiguous_attention(batch)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(1, 80), st.integers(1, 80)), min_size=1, max_size=5),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([1, 4, 8, 16]),
    seed=st.integers(0, 2**16),
)
def test_reference_attention_hypothesis(lens, group, block_size, seed):
    seq_lens = [max(a, b) for a, b in lens]
    q_lens = [min(a, b) for a, b in lens]
    batch = make_paged_batch(seq_lens, q_lens, num_heads=2 * group, num_kv_heads=2, head_dim=16,
                             block_size=block_size, seed=seed)
    torch.testing.assert_close(R.paged_attention(*batch.args()), contiguous_attention(batch),
                               atol=1e-5, rtol=1e-5)


def test_reference_attention_writes_out():
    batch = make_paged_batch([9, 4], [2, 1], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    out = torch.full_like(batch.q, float("nan"))
    got = R.paged_attention(*batch.args(), out=out)
    assert got is out and not out.isnan().any()


def test_reference_store_kv_matches_loop():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 2, 6, 4, 2, 8, generator=gen)
    expect = pool.clone()
    key = torch.randn(5, 2, 8, generator=gen)
    value = torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([0, -1, 23, 9, -5], dtype=torch.int32)
    R.store_kv(key, value, pool[1, 0], pool[1, 1], slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect[1, 0, slot // 4, slot % 4] = key[t]
            expect[1, 1, slot // 4, slot % 4] = value[t]
    assert torch.equal(pool, expect)


def test_reference_copy_blocks_matches_loop():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(3, 2, 8, 4, 2, 8, generator=gen)
    src, dst = torch.tensor([0, 5, 2]), torch.tensor([7, 1, 3])

    per_layer, expect = pool.clone(), pool.clone()
    R.copy_blocks(per_layer[2, 0], per_layer[2, 1], src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        expect[2, :, d] = pool[2, :, s]
    assert torch.equal(per_layer, expect)

    all_layers, expect = pool.clone(), pool.clone()
    R.copy_blocks_all_layers(all_layers, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        expect[:, :, d] = pool[:, :, s]
    assert torch.equal(all_layers, expect)
