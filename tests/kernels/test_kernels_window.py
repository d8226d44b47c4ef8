"""Sliding-window attention and logit soft-capping in every paged-attention
path: the torch reference against the independent per-token computation
(``kvpager_kernels.testing.contiguous_attention``), the C++ CPU kernel and the Triton
kernel against the reference. Blocks wholly before every query's window are
dropped from the tables (-1) and filled with NaN, as the sliding-window
block manager leaves them: no path may read one."""

import pytest
import torch

from kvpager_kernels import cpu_attention, cpu_build
from kvpager_kernels import reference as R
from kvpager_kernels.testing import contiguous_attention, drop_out_of_window, eager_attention, make_paged_batch

MIXES = {
    # name: (seq_lens, q_lens)
    "decode": ([1, 70, 9, 130, 33], [1, 1, 1, 1, 1]),
    "mixed": ([5, 70, 9, 33, 120], [5, 1, 3, 1, 40]),  # a 40-row chunk (in place in the cpu backend's fp32)
    "long_chunk": ([700, 20], [300, 20]),  # a chunk over the in-place budget (the cpu backend's SDPA path)
    "prefix_hit": ([150, 20], [13, 20]),
    "chunk_spans_windows": ([100], [100]),
}
WINDOWS = [1, 7, 16, 33]


def _batch(mix, window, block_size=8, group=2, dtype=torch.float32, device="cpu", drop=True, head_dim=32):
    seq_lens, q_lens = MIXES[mix]
    batch = make_paged_batch(seq_lens, q_lens, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=device)
    if drop:
        drop_out_of_window(batch, window)
    return batch


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_window_matches_contiguous(mix, window, block_size):
    batch = _batch(mix, window, block_size)
    got = R.paged_attention(*batch.args(), window=window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, contiguous_attention(batch, window), atol=1e-5, rtol=1e-5)


def test_window_drops_blocks_and_a_huge_window_is_plain_causal():
    batch = _batch("decode", 16)
    assert sum(1 for x in batch.block_tables.flatten().tolist() if x == -1) > 0
    plain = _batch("mixed", 1000, drop=False)
    torch.testing.assert_close(R.paged_attention(*plain.args(), window=1000), R.paged_attention(*plain.args()))


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("softcap", [5.0, 50.0])
def test_reference_softcap_matches_contiguous(window, softcap):
    batch = _batch("mixed", window or 1, drop=window is not None)
    batch.q.mul_(4)  # scores large enough for the cap to bite
    got = R.paged_attention(*batch.args(), window=window, softcap=softcap)
    torch.testing.assert_close(got, contiguous_attention(batch, window, softcap), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, R.paged_attention(*batch.args(), window=window), atol=1e-3)


def test_plan_for_another_window_is_refused():
    batch = _batch("decode", 16)
    plan = R.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 8,
                            batch.k_cache.shape[0], 16)
    with pytest.raises(ValueError, match="window"):
        R.paged_attention(*batch.args(), plan=plan, window=8)


needs_cpu = pytest.mark.skipif(not cpu_build.available(), reason="the C++ CPU kernels did not build here")


@needs_cpu
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_dim", [32, 24])  # 24: the generic (not 16-lane) path
def test_cpu_window_matches_reference(mix, window, head_dim):
    batch = _batch(mix, window, block_size=8, head_dim=head_dim)
    got = cpu_attention.paged_attention(*batch.args(), window=window)
    torch.testing.assert_close(got, R.paged_attention(*batch.args(), window=window), atol=2e-5, rtol=2e-5)


@needs_cpu
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_softcap_matches_reference(window, dtype):
    batch = _batch("mixed", window or 1, dtype=dtype, drop=window is not None)
    batch.q.mul_(4)
    got = cpu_attention.paged_attention(*batch.args(), window=window, softcap=20.0)
    if dtype == torch.float32:
        want = R.paged_attention(*batch.args(), window=window, softcap=20.0)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:  # each of Gemma 2's capping ops rounded to bf16, as transformers' eager attention does
        eager = eager_attention(batch, window, 20.0)
        assert (got == eager).float().mean().item() >= 0.99
        torch.testing.assert_close(got.float(), eager.float(), atol=2 ** -6, rtol=2 ** -6)


def _triton():
    try:
        from kvpager_kernels.triton_paged_attention import paged_attention_impl
        return paged_attention_impl
    except Exception:  # noqa: BLE001 - no triton here
        pytest.skip("triton is not available")


@pytest.mark.parametrize("mix", ["decode", "prefix_hit", "chunk_spans_windows"])
@pytest.mark.parametrize("window", [7, 33])
def test_triton_window_matches_reference(device, mix, window):
    impl = _triton()
    batch = _batch(mix, window, block_size=16, device=device)
    for split in ([None, False] if mix == "decode" else [None]):
        got = impl(*batch.args(), window=window, split_decode=split)
        want = R.paged_attention(*batch.args(), window=window)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [7, 64, 100])
def test_triton_split_decode_partitions_tile_the_window(device, window):
    """Flash-decoding's partitions cover only the window: several partitions
    per window (64-token partitions), a window wider than some contexts."""
    impl = _triton()
    batch = _batch("decode", window, block_size=16, device=device)
    got = impl(*batch.args(), window=window, split_decode=True, partition_size=64)
    want = R.paged_attention(*batch.args(), window=window)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_triton_softcap_matches_reference(device, mix):
    impl = _triton()
    batch = _batch(mix, 16, block_size=16, device=device)
    batch.q.mul_(4)
    got = impl(*batch.args(), window=16, softcap=20.0)
    want = R.paged_attention(*batch.args(), window=16, softcap=20.0)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)
