"""Element offsets past 2**31 and stale/NaN memory outside sequences.

Large offsets: a cache whose block ids times the block stride exceed 2**31
elements needs > 4 GiB even in fp16. ``torch.empty`` of that size only
reserves virtual memory (pages materialise when touched), and the Triton
interpreter passes CPU storages through without copying them, so we can
allocate a [2**21 + 64, 16, 1, 64] fp16 cache pair (2 x 4.3 GB virtual),
write only blocks near the top, and check every kernel there against the
reference. Any int32 product block_id * stride_block (up to ~2**31 + 2**16)
would wrap negative and read or write the wrong address (or segfault).
"""

import pytest
import torch

import kvpager_kernels as kernels
from kvpager_kernels import reference as R
from kvpager_kernels.testing import make_paged_batch
from kvpager_kernels.triton_paged_attention import paged_attention_impl

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 1, 64
NUM_BLOCKS = 2**21 + 64  # block stride 1024 elements: top blocks start past 2**31
TOP = 2**31 // (BLOCK_SIZE * KV_HEADS * HEAD_DIM)  # first block whose offset >= 2**31


@pytest.fixture(scope="module")
def huge_pool(device):
    if device != "cpu":
        pytest.skip("the lazily-committed huge allocation trick is for CPU runs")
    if torch.are_deterministic_algorithms_enabled():
        pytest.skip("deterministic mode fills torch.empty, committing 8.6 GB")
    try:
        # [L=1, 2, NB, BS, KVH, D] fp16: 2 * 2**31 elements of virtual memory
        pool = torch.empty((1, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=torch.float16)
    except RuntimeError as exc:  # no overcommit on this machine
        pytest.skip(f"cannot reserve the huge pool: {exc}")
    return pool


def test_offsets_past_int32(huge_pool, tol):
    pool = huge_pool
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    assert TOP * k_cache.stride(0) >= 2**31
    # A prefill chunk (prefix hit) and a decode, all in blocks above 2**31.
    top_ids = [TOP + 7, TOP + 40, NUM_BLOCKS - 1, TOP + 3, TOP + 21, NUM_BLOCKS - 2, TOP + 60]
    batch = make_paged_batch([40, 50], [9, 1], num_heads=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             block_size=BLOCK_SIZE, dtype=torch.float16, block_ids=top_ids,
                             pool=pool, spare_blocks=0)
    _assert_close(paged_attention_impl(*batch.args()), R.paged_attention(*batch.args()), tol)
    _assert_close(paged_attention_impl(*batch.args(), split_decode=False), R.paged_attention(*batch.args()), tol)

    # store_kv into the top blocks, then read back by plain indexing.
    key = torch.randn(3, KV_HEADS, HEAD_DIM).half()
    value = torch.randn(3, KV_HEADS, HEAD_DIM).half()
    slots = torch.tensor([(NUM_BLOCKS - 1) * BLOCK_SIZE + 15, -1, (TOP + 5) * BLOCK_SIZE + 2])
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[NUM_BLOCKS - 1, 15], key[0]) and torch.equal(v_cache[TOP + 5, 2], value[2])

    # copy_blocks between top blocks (and from a low block upward).
    k_cache[3] = 1.5
    src = torch.tensor([NUM_BLOCKS - 1, 3])
    dst = torch.tensor([TOP + 30, NUM_BLOCKS - 3])
    kernels.copy_blocks(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache[TOP + 30], k_cache[NUM_BLOCKS - 1])
    assert torch.equal(v_cache[TOP + 30], v_cache[NUM_BLOCKS - 1])
    assert torch.equal(k_cache[NUM_BLOCKS - 3], k_cache[3])


def test_copy_blocks_all_layers_past_int32(huge_pool):
    # Here the whole pool is one tensor: offsets also cross 2**31 through the
    # K/V axis (v starts 2**31 + 2**16 elements in).
    pool = huge_pool
    pool[0, :, TOP + 50] = 2.0
    pool[0, 1, TOP + 51] = -3.0
    kernels.copy_blocks_all_layers(pool, torch.tensor([TOP + 50, TOP + 51]), torch.tensor([NUM_BLOCKS - 5, 10]))
    assert torch.equal(pool[0, :, NUM_BLOCKS - 5], pool[0, :, TOP + 50])
    assert torch.equal(pool[0, 1, 10], pool[0, 1, TOP + 51])


def _assert_close(got, want, tol):
    torch.testing.assert_close(got.float(), want.float(), **tol(torch.float16))


@pytest.mark.parametrize("q_lens,split_decode", [
    ([5, 1, 3, 1], None),  # mixed batch: query-tiled kernel
    ([1, 1, 1, 1], None),  # decode-only: flash-decoding kernels
    ([1, 1, 1, 1], False),  # decode through the query-tiled kernel
])
def test_stale_nan_outside_sequences(device, tol, q_lens, split_decode):
    # Unused tails of last blocks, spare blocks and block 0 (a common table
    # padding value) hold NaN: neither the kernels nor the reference may let
    # it leak into outputs (masked loads; zeroed padding in the reference).
    seq_lens = [5, 70, 9, 33]
    batch = make_paged_batch(seq_lens, q_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                             device=device, pad_value=0, spare_blocks=4)
    used = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool, device=device)  # [NB, BS]
    for s, length in enumerate(seq_lens):
        pos = torch.arange(length, device=device)
        used[batch.block_tables[s].long()[pos // 16], pos % 16] = True
    batch.pool[:, :, ~used] = float("nan")
    want = R.paged_attention(*batch.args())
    got = paged_attention_impl(*batch.args(), split_decode=split_decode)
    assert not want.isnan().any() and not got.isnan().any()
    torch.testing.assert_close(got, want, **tol(torch.float32))
