"""`kvpager bench memory`'s hybrid section on small pools: the measured
concurrency of the group allocator reaches the analytic bound, and the
saving appears only once sequences outgrow the window."""

from __future__ import annotations

from kvpager_tools.bench import hybrid

SHAPE = {"num_layers": 4, "window": 64, "max_len": 256}


def test_hybrid_reaches_the_bound_past_the_window():
    got = hybrid.hybrid_capacity(256, full_blocks=200, block_size=8, chunk=32, shape=SHAPE)
    # all full: 32 blocks a sequence; hybrid: 32 + 8 (keys 193..255) half-size blocks on 400
    assert (got["concurrency_all_full"], got["bound_all_full"]) == (6, 6)
    assert got["sliding_blocks_per_seq"] == 8 and got["pool_blocks_hybrid"] == 400
    # The tenth would fit when grown, but its last prefill chunk needs 8 blocks with 4 free:
    # the bound leaves out the window's transient chunk, so a small pool lands one short.
    assert (got["concurrency_hybrid"], got["bound_hybrid"]) == (9, 10)
    assert got["ratio"] == 1.5 and got["ratio_bound"] == round(10 / 6, 4)
    full, sliding = got["groups"]
    assert (full["window"], full["used_blocks"], full["window_saved_blocks"]) == (None, 9 * 32, 0)
    assert (sliding["window"], sliding["used_blocks"], sliding["full_attention_blocks"]) == (64, 9 * 8, 9 * 32)
    assert sliding["window_saved_blocks"] == 9 * 24


def test_no_saving_within_the_window():
    got = hybrid.hybrid_capacity(64, full_blocks=200, block_size=8, chunk=32, shape=SHAPE)
    assert got["concurrency_hybrid"] == got["concurrency_all_full"] == 25 and got["ratio"] == 1.0


def test_sliding_blocks_arithmetic():
    assert hybrid.sliding_blocks(100, 64, 8) == 13 - 37 // 8  # keys 37..99: blocks 4..12
    assert hybrid.sliding_blocks(10, 64, 8) == 2
