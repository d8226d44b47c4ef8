"""`kvpager bench memory`'s hybrid section: how many sequences one pool holds
for a Gemma-2-shaped model (half the layers sliding) when the block manager
keeps a table per KV group and frees what the window passed, against the
same pool bytes managed as all full attention.

Measured through the memory service's group allocator (``GroupedKV``): the
same fill (sequences admitted and grown in prefill chunks to N tokens, one
after the other, until the pool refuses) on both layouts. Layouts as the
executor's pool would hold them (vLLM's hybrid layout): all-full, a block
holds every layer; hybrid, a block holds one group's layers, so the same
bytes are twice the blocks and a sliding-group block is given back once
the window has passed it.

The analytic bound: a sequence of N tokens holds ⌈N / bs⌉ blocks in the full
group and the blocks covering [N − W + 1, N) in the sliding group, so
concurrency is ⌊2 · NB / (that sum)⌋ against ⌊NB / ⌈N / bs⌉⌋ all-full.
"""

from __future__ import annotations

import random

from kvpager.kv_spec import KvGroupSpec
from memory_service.block_pool import BlockPool
from memory_service.kv_groups import GroupedKV

# Gemma 2 2B's shape: 26 layers alternating local / global, a 4096-token window, 8192 positions.
GEMMA2 = {"num_layers": 26, "window": 4096, "max_len": 8192}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sliding_blocks(num_tokens: int, window: int, block_size: int) -> int:
    """Blocks a sequence of num_tokens holds in a sliding group after its last commit."""
    return _cdiv(num_tokens, block_size) - max(0, num_tokens - window + 1) // block_size


def fill(kv: GroupedKV, seq_len: int, chunk: int, rng: random.Random) -> list:
    """Admit and grow sequences to seq_len tokens, one after the other, until one
    cannot be; returns the sequences held at seq_len."""
    held = []
    while True:
        seq = kv.new_seq(len(held), [rng.randrange(32000) for _ in range(seq_len)], rng.randbytes(32))
        got = kv.admit(seq, chunk)
        if got is None:
            return held
        kv.commit(seq, got[1])
        while seq.num_computed < seq_len:
            k = min(chunk, seq_len - seq.num_computed)
            if not kv.allocate_slots(seq, k):
                kv.release(seq)  # the last one does not fit: it gives its blocks back
                return held
            kv.commit(seq, k)
        held.append(seq)


def hybrid_capacity(seq_len: int, full_blocks: int = 20000, block_size: int = 16, chunk: int = 512,
                    shape: dict = GEMMA2, seed: int = 0) -> dict:
    """Sequences of seq_len tokens held by a pool of ``full_blocks`` all-layer
    blocks' bytes, all full vs hybrid (half the layers sliding)."""
    num_layers, window = shape["num_layers"], shape["window"]
    half = num_layers // 2
    full_kv = GroupedKV(BlockPool("full", full_blocks, block_size), [KvGroupSpec(None, tuple(range(num_layers)))])
    # The same bytes: a hybrid block holds half the layers, so there are twice as many.
    groups = [KvGroupSpec(None, tuple(range(1, num_layers, 2))), KvGroupSpec(window, tuple(range(0, num_layers, 2)))]
    hybrid_kv = GroupedKV(BlockPool("hybrid", full_blocks * num_layers // half, block_size), groups)
    measured_full = len(fill(full_kv, seq_len, chunk, random.Random(seed)))
    held = fill(hybrid_kv, seq_len, chunk, random.Random(seed))
    measured_hybrid = len(held)
    per_seq_full = _cdiv(seq_len, block_size)
    per_seq_hybrid = per_seq_full + sliding_blocks(seq_len, window, block_size)
    bound_full = full_blocks // per_seq_full
    bound_hybrid = hybrid_kv.pool.num_blocks // per_seq_hybrid
    return {
        "seq_len": seq_len, "window": window, "num_layers": num_layers, "sliding_layers": half,
        "block_size": block_size, "prefill_chunk": chunk,
        "pool_blocks_all_full": full_blocks, "pool_blocks_hybrid": hybrid_kv.pool.num_blocks,
        "concurrency_all_full": measured_full, "concurrency_hybrid": measured_hybrid,
        "bound_all_full": bound_full, "bound_hybrid": bound_hybrid,
        "ratio": round(measured_hybrid / measured_full, 4) if measured_full else None,
        "ratio_bound": round(bound_hybrid / bound_full, 4) if bound_full else None,
        "sliding_blocks_per_seq": sliding_blocks(seq_len, window, block_size),
        "full_blocks_per_seq": per_seq_full,
        # The hybrid pool when full, per group (what GroupedKV.usage reports).
        "groups": [{"window": u.window, "layers": len(spec.layers), "used_blocks": u.used_blocks,
                    "full_attention_blocks": u.full_attention_blocks, "window_saved_blocks": u.window_saved_blocks}
                   for u, spec in zip(hybrid_kv.usage(held), groups)],
    }


def run(quick: bool = False) -> dict:
    """The hybrid section: sequence lengths up to Gemma 2's 8192 positions
    (no saving until a sequence outgrows the window), and the same shape with
    a 1024-token window (Gemma 3's) to show where the bound goes."""
    blocks = 4000 if quick else 20000
    out = {f"gemma2_len_{n}": hybrid_capacity(n, full_blocks=blocks)
           for n in ((4096, 8192) if quick else (2048, 4096, 6144, 8192))}
    short = dict(GEMMA2, window=1024)
    out["gemma2_w1024_len_8192"] = hybrid_capacity(8192, full_blocks=blocks, shape=short)
    return out
