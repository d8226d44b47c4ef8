"""Builders for random paged-attention batches (tests and benchmarks).

Pure torch; importing this module does not import triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["PagedBatch", "make_paged_batch", "contiguous_attention", "drop_out_of_window", "poison_unread"]


@dataclass
class PagedBatch:
    pool: torch.Tensor  # [L, 2, NB, BS, KVH, D]
    layer: int
    q: torch.Tensor  # [T, H, D]
    block_tables: torch.Tensor  # [S, MB] int32, unused entries = pad_value
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    scale: float

    @property
    def k_cache(self) -> torch.Tensor:  # [NB, BS, KVH, D] view
        return self.pool[self.layer, 0]

    @property
    def v_cache(self) -> torch.Tensor:  # [NB, BS, KVH, D] view
        return self.pool[self.layer, 1]

    def args(self) -> Tuple:
        """Positional arguments for paged_attention (without out)."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def context(self, s: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K, V [L_s, KVH, D] of sequence s, read by plain indexing."""
        length = int(self.seq_lens[s])
        block_size = self.k_cache.shape[1]
        pos = torch.arange(length, device=self.q.device)
        blocks = self.block_tables[s].to(torch.int64)[pos // block_size]
        return self.k_cache[blocks, pos % block_size], self.v_cache[blocks, pos % block_size]


def make_paged_batch(
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_layers: int = 1,
    layer: int = 0,
    spare_blocks: int = 3,
    extra_table_cols: int = 1,
    pad_value: int = -1,
    shuffle: bool = True,
    seed: int = 0,
    block_ids: Optional[List[int]] = None,
    pool: Optional[torch.Tensor] = None,
) -> PagedBatch:
    """Random K/V pool, shuffled block tables and queries for the given lengths.

    seq_lens[s] is sequence s's total context, q_lens[s] <= seq_lens[s] its
    number of new (query) tokens. block_ids, if given, are the physical
    blocks to hand out in order (e.g. ids near the top of a huge pool passed
    as ``pool``, left unfilled except for the used blocks).
    """
    assert len(seq_lens) == len(q_lens) and all(1 <= q <= s for q, s in zip(q_lens, seq_lens))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    needed = sum(blocks_per_seq)

    if block_ids is None:
        num_blocks = needed + spare_blocks
        order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
        block_ids = order[:needed].tolist()
    assert len(block_ids) >= needed

    if pool is None:
        num_blocks = max(block_ids) + 1 + spare_blocks
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        pool = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    else:
        # Huge pools are left uninitialised; fill only the blocks in use.
        ids = torch.tensor(block_ids[:needed], dtype=torch.int64, device=pool.device)
        fill = torch.randn((pool.shape[0], 2, needed, *pool.shape[3:]), generator=gen)
        pool[:, :, ids] = fill.to(device=pool.device, dtype=pool.dtype)

    max_blocks = max(blocks_per_seq) + extra_table_cols
    table = torch.full((len(seq_lens), max_blocks), pad_value, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        table[s, :n] = torch.tensor(block_ids[used:used + n], dtype=torch.int32)
        used += n

    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1], num_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    return PagedBatch(
        pool=pool,
        layer=layer,
        q=q,
        block_tables=table.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5,
    )


def poison_unread(batch: PagedBatch, value: float = float("nan")) -> None:
    """Fill every pool slot no sequence may read (past each length, and the
    blocks no table uses) with ``value``, in place."""
    block_size = batch.pool.shape[3]
    used = set()
    for s, n in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[s, : -(-n // block_size)].tolist()
        used.update(blocks)
        if n % block_size:
            batch.pool[:, :, blocks[-1], n % block_size:] = value
    for b in set(range(batch.pool.shape[2])) - used:
        batch.pool[:, :, b] = value


def drop_out_of_window(batch: PagedBatch, window: int) -> int:
    """What a sliding-window block manager does: table entries of blocks that
    no query of the sequence can see (wholly before its first query's window)
    become -1, and those blocks are filled with NaN, so a kernel that reads
    one poisons its output. Returns how many entries were dropped."""
    block_size = batch.k_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    dropped = 0
    for s, length in enumerate(batch.seq_lens.tolist()):
        first_query = length - (starts[s + 1] - starts[s])
        n = max(0, first_query - window + 1) // block_size  # blocks wholly before the window
        for b in range(n):
            blk = int(batch.block_tables[s, b])
            batch.pool[:, :, blk] = float("nan")
            batch.block_tables[s, b] = -1
            dropped += 1
    return dropped


def contiguous_attention(batch: PagedBatch, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """Independent expected output: per sequence, torch SDPA (fp32) on the
    contiguous context with a causal mask aligned to the *end* of the context
    (query j of a q_len-token chunk sees keys 0 .. L - q_len + j); with a
    sliding ``window`` only keys > its position - window, with ``softcap``
    explicit soft-capped scores (as transformers' eager Gemma 2 attention).

    Returns [T, H, D] fp32. Deliberately a plain per-sequence loop.
    """
    if window is not None or softcap is not None:
        return _windowed_attention(batch, window, softcap)
    q_all = batch.q.float()
    num_heads = q_all.shape[1]
    out = torch.empty_like(q_all)
    starts = batch.query_start_loc.tolist()
    for s in range(len(starts) - 1):
        k, v = batch.context(s)  # [L, KVH, D]
        group = num_heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        q = q_all[starts[s]:starts[s + 1]].transpose(0, 1)  # [H, Q, D]
        n_q, n_kv = q.shape[1], k.shape[1]
        mask = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril(diagonal=n_kv - n_q)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale)
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1)
    return out


def _windowed_attention(batch: PagedBatch, window: int | None, softcap: float | None) -> torch.Tensor:
    """contiguous_attention's window / soft-capping case: explicit scores per
    query token, only the keys it may see gathered (so dropped blocks are
    never read here either)."""
    return eager_attention(batch, window, softcap, model_dtype=False)


def eager_attention(batch: PagedBatch, window: int | None = None, softcap: float | None = None,
                    model_dtype: bool = True) -> torch.Tensor:
    """Transformers' eager attention, one query token at a time over the keys
    it may see. ``model_dtype``: op for op in the batch's dtype as
    transformers writes it (``matmul(q, k^T) * scaling``, Gemma 2's
    ``tanh(s / cap) * cap``, ``softmax(dtype=float32).to(dtype)``, then
    ``matmul(p, v)``: each op's result held in that dtype, its sums in fp32),
    so a 16-bit batch rounds where transformers rounds; else all in fp32.
    Returns [T, H, D] in the batch's dtype (``model_dtype``) or fp32."""
    dtype = batch.q.dtype if model_dtype else torch.float32
    q_all = batch.q.to(dtype)
    out = torch.empty_like(q_all)
    starts = batch.query_start_loc.tolist()
    block_size = batch.k_cache.shape[1]
    for s in range(len(starts) - 1):
        length = int(batch.seq_lens[s])
        n_q = starts[s + 1] - starts[s]
        table = batch.block_tables[s].to(torch.int64)
        for j in range(n_q):
            pos = length - n_q + j
            lo = 0 if window is None else max(0, pos - window + 1)
            keys = torch.arange(lo, pos + 1)
            blocks = table[keys // block_size]
            k = batch.k_cache[blocks, keys % block_size].to(dtype)  # [N, KVH, D]
            v = batch.v_cache[blocks, keys % block_size].to(dtype)
            group = q_all.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, N, D]
            v = v.repeat_interleave(group, dim=1).transpose(0, 1)
            q = q_all[starts[s] + j][:, None, :]  # [H, 1, D]
            scores = torch.matmul(q, k.transpose(1, 2)) * batch.scale  # [H, 1, N]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
            out[starts[s] + j] = torch.matmul(probs, v)[:, 0]
    return out
