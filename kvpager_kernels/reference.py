"""Pure-torch reference implementations of the paged KV-cache kernels.

These double as the executor's CPU ("torch") backend, so they are vectorised:
no per-token Python loops. Signatures match the Triton launchers in
``kernels`` exactly. Importing this module never imports triton.

Layouts (see docs/kernels.md):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
      (possibly a per-layer view ``pool[layer, 0]`` of a larger pool)
  slot of a token = block_id * block_size + offset_in_block
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "store_kv",
    "paged_attention",
    "plan_attention",
    "copy_blocks",
    "copy_blocks_all_layers",
]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V into the paged cache, in place.

    key, value: [T, KVH, D]; slot_mapping: [T] int32/int64, negative = skip.
    """
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)  # [T]
    if bool((slots < 0).any()):
        # Boolean-filter so skipped tokens never produce an index (a negative
        # index would silently wrap around to the last block).
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        # One row per slot: index_copy_ on the [NB * BS, KVH, D] view.
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))
        return
    block_size = k_cache.shape[1]
    blocks = torch.div(slots, block_size, rounding_mode="floor")  # [T']
    offsets = slots - blocks * block_size  # [T']
    # index_put_ writes through views, so any strided cache works.
    k_cache.index_put_((blocks, offsets), key.to(k_cache.dtype))
    v_cache.index_put_((blocks, offsets), value.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, max_len: int,
    lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gather sequences' context tokens through their block tables.

    cache: [NB, BS, KVH, D]; block_table: [S, MB]; lengths: [S] on the
    cache's device, None when every sequence is max_len long
    -> [S, max_len, KVH, D], zero past each length.
    """
    block_size = cache.shape[1]
    group = _gather_plan(block_table, max_len, lengths, block_size, cache.shape[0])
    return _gather(cache, group)


@dataclass(slots=True)
class _Gather:
    """Where one padded gather reads (blocks) and what it zeroes (token rows)."""

    block_ids: torch.Tensor            # [S * n_blocks] int64, clamped into the pool
    pad_rows: Optional[torch.Tensor]   # [P] int64 rows of the [S * width] gathered tokens to zero
    num_seqs: int
    width: int                         # n_blocks * block_size (>= max_len)
    max_len: int


def _gather_plan(block_table: torch.Tensor, max_len: int, lengths: Optional[torch.Tensor], block_size: int,
                 num_blocks: int, first_blocks: torch.Tensor | None = None,
                 skip: torch.Tensor | None = None) -> _Gather:
    """first_blocks: [S] int64, the table index each sequence's gather starts
    at (a sliding window's first block; None = 0), so ``lengths`` and
    ``max_len`` count tokens from that block on; skip: [S] int64 leading
    tokens of the first block to zero (before the window)."""
    n_blocks = (max_len + block_size - 1) // block_size
    if first_blocks is None:
        table = block_table[:, :n_blocks]
    else:
        cols = first_blocks[:, None] + torch.arange(n_blocks, device=block_table.device)[None, :]  # [S, n]
        table = block_table.gather(1, cols.clamp(max=block_table.shape[1] - 1))
    # Table entries past a sequence's last block (or before its window) may
    # be padding (e.g. -1); clamp them to a valid id: those positions are zeroed.
    table = table.to(torch.int64).clamp(0, num_blocks - 1)
    s, width = table.shape[0], n_blocks * block_size
    pad_rows = None
    if lengths is not None or skip is not None:
        j = torch.arange(width, device=table.device)[None, :]
        pad = torch.zeros((s, width), dtype=torch.bool, device=table.device)
        if lengths is not None:
            pad |= j >= lengths[:, None]  # [S, width]
        if skip is not None:
            pad |= j < skip[:, None]
        pad_rows = pad.reshape(-1).nonzero().squeeze(1)
        if pad_rows.numel() == 0:
            pad_rows = None
    return _Gather(table.reshape(-1), pad_rows, s, width, max_len)


def _gather(cache: torch.Tensor, g: _Gather) -> torch.Tensor:
    """-> [S, max_len, KVH, D] (a view of a fresh copy), zero past each length."""
    # index_select copies whole contiguous blocks: several times faster on
    # CPU than advanced indexing (cache[table]) for the same bytes.
    gathered = cache.index_select(0, g.block_ids)  # [S * n_blocks, BS, KVH, D]
    if g.pad_rows is not None:
        # Slots past a sequence's length hold stale or uninitialised memory
        # that may be NaN/inf; masking scores is not enough (0 * NaN = NaN in
        # P @ V). Zero those token rows (index_fill_ on whole rows is ~5x
        # cheaper than a broadcast masked_fill_).
        gathered.view(g.num_seqs * g.width, -1).index_fill_(0, g.pad_rows, 0)
    return gathered.view(g.num_seqs, g.width, *cache.shape[2:])[:, : g.max_len]


def _length_groups(lens: torch.Tensor, max_groups: int = 4, ratio: float = 0.6) -> list[torch.Tensor]:
    """Split sequences into at most ``max_groups`` groups of similar length so
    that padding each group to its longest wastes little (a new group starts
    when a length falls below ``ratio`` x the group's longest).

    lens: [S] int64 on CPU -> index tensors into lens, longest group first.
    """
    order = torch.argsort(lens, descending=True)
    sorted_lens = lens[order].tolist()
    cuts, head = [0], sorted_lens[0]
    for i, n in enumerate(sorted_lens):
        if n < ratio * head and len(cuts) < max_groups:
            cuts.append(i)
            head = n
    cuts.append(len(sorted_lens))
    return [order[a:b] for a, b in zip(cuts, cuts[1:])]


@dataclass(slots=True)
class _DecodeGroup:
    rows: torch.Tensor    # [Sd] token index of each decode
    mask: torch.Tensor    # [Sd, 1, 1, max_len] bool: key position < seq_len
    gather: _Gather


@dataclass(slots=True)
class _Prefill:
    start: int
    stop: int
    mask: Optional[torch.Tensor]  # [Q, L] bool; None = plain causal (no cached context)
    gather: _Gather


@dataclass(slots=True)
class AttentionPlan:
    """What ``paged_attention`` does for one batch, independent of the layer:
    built once per forward (``plan_attention``) and passed to every layer's
    call, so the per-layer work is the gathers and the attention itself."""

    decodes: list = field(default_factory=list)   # [_DecodeGroup]
    prefills: list = field(default_factory=list)  # [_Prefill]
    window: int | None = None                  # the sliding window it was planned for


def window_start(first_query_pos: int, window: int | None) -> int:
    """The first key position any query at or after ``first_query_pos`` sees
    (transformers' sliding window: key > query - window)."""
    return 0 if window is None else max(0, first_query_pos - window + 1)


def plan_attention(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
    num_blocks: int, window: int | None = None, dtype: torch.dtype | None = None, head_dim: int | None = None,
) -> AttentionPlan:
    """The layer-independent part of ``paged_attention`` (same arguments):
    one plan per distinct ``window`` of the model's layers. ``dtype`` and
    ``head_dim`` (the KV pool's) are part of the backends' planning
    interface; this plan's split depends on neither."""
    plan = AttentionPlan(window=window)
    device = block_tables.device
    # One host sync for the whole batch: the sequence lengths decide shapes.
    qsl = query_start_loc.to(torch.int64).cpu()
    lens = seq_lens.to(torch.int64).cpu()
    q_lens = qsl[1:] - qsl[:-1]  # [S]
    if lens.numel() == 0:
        return plan
    # Decodes (q_len == 1) share padded attention calls; each prefill chunk
    # gets its own call, which avoids padding a big batch of decodes up to
    # the longest prefill's query length. Decodes of similar length share a
    # call (padding every decode to the longest one would gather and attend
    # ~2x the context of a typical mixed batch).
    decode_idx = torch.nonzero(q_lens == 1).flatten()
    if decode_idx.numel() > 0:
        # Under a window a decode reads from its window's first block on:
        # ``first`` blocks are skipped, ``skip`` tokens of the next one masked.
        first_tok = (lens - window).clamp(min=0) if window is not None else torch.zeros_like(lens)
        first_blk = torch.div(first_tok, block_size, rounding_mode="floor")
        span = lens - first_blk * block_size  # [S] tokens gathered from the first block on
        for group in _length_groups(span[decode_idx]):
            seqs = decode_idx[group]  # [Sd] sequence indices
            d_span = span[seqs]
            max_len = int(d_span.max())
            seqs_dev, d_span_dev = seqs.to(device), d_span.to(device)
            j = torch.arange(max_len, device=device)[None, :]
            mask = j < d_span_dev[:, None]
            first = skip = None
            if window is not None:
                first = first_blk[seqs].to(device)
                skip = (first_tok[seqs] - first_blk[seqs] * block_size).to(device)
                mask &= j >= skip[:, None]
            plan.decodes.append(_DecodeGroup(
                rows=qsl[:-1][seqs].to(device), mask=mask[:, None, None, :],
                gather=_gather_plan(block_tables[seqs_dev], max_len, d_span_dev, block_size, num_blocks,
                                    first, skip)))
    for s in torch.nonzero(q_lens > 1).flatten().tolist():
        plan.prefills.append(_plan_prefill(block_tables, s, qsl, lens, block_size, num_blocks, device, window))
    return plan


def _plan_prefill(block_tables, s: int, qsl, lens, block_size: int, num_blocks: int, device,
                  window: int | None = None) -> _Prefill:
    """Sequence s's chunk: its query rows, the mask and its context's gather
    (from the first block its first query's window reaches)."""
    start, stop = int(qsl[s]), int(qsl[s + 1])
    n_q, n_kv = stop - start, int(lens[s])
    first_tok = window_start(n_kv - n_q, window)
    base = first_tok // block_size * block_size  # first gathered position
    mask = None
    if n_q != n_kv or window is not None:  # causal aligned to the end, and/or windowed
        q_pos = torch.arange(n_kv - n_q, n_kv, device=device)  # [Q]
        k_pos = torch.arange(base, n_kv, device=device)  # [L']
        mask = k_pos[None, :] <= q_pos[:, None]  # [Q, L']
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
    if base == 0:
        gather = _gather_plan(block_tables[s : s + 1], n_kv, None, block_size, num_blocks)
    else:
        first = torch.tensor([base // block_size], device=block_tables.device)
        skip = torch.tensor([first_tok - base], device=block_tables.device)
        gather = _gather_plan(block_tables[s : s + 1], n_kv - base, None, block_size, num_blocks, first, skip)
    return _Prefill(start, stop, mask, gather)


def _attend_prefill(q, k_cache, v_cache, p: _Prefill, scale: float, out: torch.Tensor,
                    softcap: float | None = None, native: bool = False) -> None:
    """One chunk: its context gathered once, then SDPA; writes out[p.start:p.stop].
    ``native``: attend in q's dtype (see ``_attend``), not upcast to fp32."""
    k = _gather(k_cache, p.gather)  # [1, L, KVH, D]
    v = _gather(v_cache, p.gather)
    qs = q[p.start : p.stop].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    # No cached context: plain causal (the kernel skips masked blocks).
    o = _attend(qs, k.transpose(1, 2), v.transpose(1, 2), p.mask, scale, is_causal=p.mask is None,
                softcap=softcap, native=native)
    out[p.start : p.stop] = o[0].transpose(0, 1).to(out.dtype)


def _attend_softcap(q, k, v, mask: Optional[torch.Tensor], scale: float, softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's logit soft-capping (SDPA has none):
    scores = softcap * tanh(q.k * scale / softcap), then masked softmax.
    q: [B, H, M, D]; k, v: [B, KVH, N, D] fp32 -> [B, H, M, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, M, N]
    s = torch.tanh(s / softcap) * softcap
    if mask is None:  # causal, M == N
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
    is_causal: bool = False, softcap: float | None = None, native: bool = False,
) -> torch.Tensor:
    """Masked attention with GQA, in fp32 (or the inputs' dtype, see ``native``).

    q: [B, H, M, D]; k, v: [B, KVH, N, D]; mask: bool broadcastable to
    [B, H, M, N] (True = attend), or None with ``is_causal`` (M == N)
    -> [B, H, M, D] fp32. ``native`` (no soft-capping): SDPA in the inputs'
    dtype -> [B, H, M, D] in it. For bf16 that is close to the arithmetic of
    transformers' eager bf16 attention (bf16 products with fp32 sums, fp32
    softmax, bf16 probabilities times V; its flash kernel keeps the scores
    in fp32 where eager rounds them: the in-place CPU kernel rounds as eager
    does) at 2.5-3x the speed of the fp32 upcast on a CPU with AMX
    (docs/benchmarks.md).
    """
    if softcap or not native:
        q, k, v = q.float(), k.float(), v.float()
    if softcap:
        return _attend_softcap(q, k, v, mask, scale, softcap)
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal)
    try:
        # ~10x faster on CPU than materialising repeated K/V.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal,
                                              enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
    plan: Optional[AttentionPlan] = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of flattened new tokens over the paged cache.

    q: [T, H, D] (all sequences' new tokens, concatenated);
    block_tables: [S, MB] int32; seq_lens: [S] int32 (total context incl. the
    new tokens); query_start_loc: [S + 1] int32 cumulative query lengths.
    Query token j of seq s sits at absolute position seq_lens[s] - q_len[s] + j
    and attends to positions <= its own, and with a sliding ``window`` only to
    positions > its own - window (table entries of blocks no query's window
    reaches are never read: they may be padding). ``softcap``: Gemma 2's
    logit soft-capping (None = off). ``plan``: ``plan_attention`` of the
    same arguments and window, to share across layers (built here when None).
    Returns [T, H, D] in q.dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if plan is None:
        plan = plan_attention(block_tables.to(q.device), seq_lens, query_start_loc, k_cache.shape[1],
                              k_cache.shape[0], window)
    elif plan.window != window:
        raise ValueError(f"attention plan made for window {plan.window}, called with {window}")
    kvh = k_cache.shape[2]
    for d in plan.decodes:
        k = _gather(k_cache, d.gather)  # [Sd, L, KVH, D]
        v = _gather(v_cache, d.gather)
        sd = d.gather.num_seqs
        # A decode's query heads sharing a kv head all see the same keys with
        # no causal mask, so the group becomes a short query block:
        # q [Sd, KVH, G, D] against k [Sd, KVH, L, D] (the fastest CPU form).
        qd = q.index_select(0, d.rows).reshape(sd, kvh, num_heads // kvh, head_dim)
        o = _attend(qd, k.transpose(1, 2), v.transpose(1, 2), d.mask, scale, softcap=softcap)
        out.index_copy_(0, d.rows, o.reshape(sd, num_heads, head_dim).to(out.dtype))
    for p in plan.prefills:
        _attend_prefill(q, k_cache, v_cache, p, scale, out, softcap)
    return out


def copy_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy whole blocks src[i] -> dst[i] in both caches (copy-on-write).

    src, dst: [P] int. All reads happen before writes; dst ids must be
    distinct (the Triton kernel additionally requires dst disjoint from src).
    """
    src = src.to(device=k_cache.device, dtype=torch.int64)
    dst = dst.to(device=k_cache.device, dtype=torch.int64)
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def copy_blocks_all_layers(
    kv_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """copy_blocks for every layer and both K and V of the whole pool.

    kv_pool: [L, 2, NB, BS, KVH, D]; src, dst: [P] int.
    """
    src = src.to(device=kv_pool.device, dtype=torch.int64)
    dst = dst.to(device=kv_pool.device, dtype=torch.int64)
    kv_pool[:, :, dst] = kv_pool[:, :, src]
