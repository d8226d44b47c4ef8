"""Triton paged attention: query-tiled kernel for prefill/mixed batches and a
flash-decoding (split-KV) pair of kernels for decode-only batches.

One concept (one module past the usual size): both paths share the block
table walk, the masking and the launcher that picks between them.

Shapes (see docs/kernels.md):
  q, out:        [T, H, D]          all sequences' new tokens, flattened
  k/v cache:     [NB, BS, KVH, D]   any strides (per-layer pool views)
  block_tables:  [S, MB]  seq_lens: [S]  query_start_loc: [S + 1]
Every sequence must have at least one query token (query_start_loc strictly
increasing); then "T == S" means the batch is decode-only, decided from shapes
alone so the launcher never synchronises with the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kvpager_kernels._jit import is_interpreted, next_pow2
from kvpager_kernels.checks import check_cache_pair, check_float_dtype, check_index

__all__ = ["paged_attention", "paged_attention_impl", "decode_partition_size"]

# Finite "minus infinity": -inf would turn exp2(m_old - m_new) into NaN when a
# row has seen no valid key yet (-inf - -inf).
_NEG_BIG = -1.0e30


@triton.jit
def _scores(s, scale, softcap, SOFTCAP: tl.constexpr):
    """Raw dot products -> log2-domain scores, soft-capped (Gemma 2) when
    SOFTCAP: cap * tanh(s * scale / cap), tanh written with exp (exact at
    the saturated ends: 2 / (inf + 1) = 0)."""
    if SOFTCAP:
        x = s * (scale / softcap)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
        return s * 1.4426950408889634
    return s * (scale * 1.4426950408889634)  # fold log2(e): softmax via exp2


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, num_seqs, head_dim, window, softcap,
    stride_q_t, stride_q_h, stride_q_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_kc_b, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_t, stride_vc_h, stride_vc_d,
    stride_bt_s, stride_bt_b,
    QUERIES_PER_KV: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DIM_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NEG_BIG: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # grid: (query tiles, kv heads). A program owns BLOCK_Q query tokens of one
    # sequence times the QUERIES_PER_KV query heads sharing one kv head, so
    # every K/V tile it loads serves BLOCK_M = BLOCK_Q * QPK_PAD rows (GQA).
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)

    # Tile -> sequence without a host-built map: sequence i's tiles start at
    # query_start[i] // BLOCK_Q + i (the "+ i" absorbs each sequence's partial
    # last tile), a strictly increasing key, so binary-search the last
    # sequence whose first tile <= this tile.
    lo = num_seqs * 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = (lo - 1).to(tl.int64)

    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    ctx_len = seq_len - q_len  # tokens cached before this step's queries
    first_q = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # within the seq

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + (rows // QPK_PAD).to(tl.int64)  # [M] query index in seq
    head = kv_head * QUERIES_PER_KV + (rows % QPK_PAD)  # [M]
    row_ok = (q_idx < q_len) & ((rows % QPK_PAD) < QUERIES_PER_KV)  # [M]
    q_pos = ctx_len + q_idx  # [M] absolute position of each row's token
    d = tl.arange(0, DIM_PAD).to(tl.int64)
    d_ok = d < head_dim
    d_k = d * stride_kc_d  # [DP] element offsets within a token's head row
    d_v = d * stride_vc_d

    q_off = (q_start + q_idx)[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :] * stride_q_d
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, DP]
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys past this tile's last query are causally masked for every row;
    # under a sliding window, keys before its first query's window too
    # (their blocks are never read: the table may hold padding there).
    kv_end = tl.minimum(ctx_len + first_q + BLOCK_Q, seq_len)
    kv_end = tl.where(first_q < q_len, kv_end, 0)  # trailing spare tile: no work
    kv_lo = ctx_len * 0
    if WINDOW:
        kv_lo = tl.maximum(ctx_len + first_q - window + 1, 0)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt_s
    for start in range(kv_lo, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N).to(tl.int64)  # [N]
        pos_ok = pos < kv_end
        # Per-token block lookup, so a tile may span several small blocks.
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_bt_b, mask=pos_ok, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k_rows = k_cache_ptr + (block * stride_kc_b + in_block * stride_kc_t + kv_head * stride_kc_h)  # [N] ptrs
        v_rows = v_cache_ptr + (block * stride_vc_b + in_block * stride_vc_t + kv_head * stride_vc_h)
        k = tl.load(k_rows[:, None] + d_k[None, :], mask=kv_mask, other=0.0)  # [N, DP]
        v = tl.load(v_rows[:, None] + d_v[None, :], mask=kv_mask, other=0.0)  # [N, DP]
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = _scores(s, scale, softcap, SOFTCAP)  # [M, N]
        valid = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if WINDOW:
            valid = valid & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(valid, s, NEG_BIG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # where(): a row with no valid key yet has m_new == NEG_BIG and would
        # otherwise get exp2(0) = 1 for its masked entries.
        p = tl.where(valid, tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + q_idx)[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :] * stride_o_d
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,
    part_o_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, head_dim, partition_size, window, softcap,
    stride_q_t, stride_q_h, stride_q_d,
    stride_kc_b, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_t, stride_vc_h, stride_vc_d,
    stride_bt_s, stride_bt_b,
    stride_po_s, stride_po_h, stride_po_p,
    stride_pm_s, stride_pm_h,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DIM_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NEG_BIG: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # grid: (seqs, kv heads, partitions). Flash-decoding: each program attends
    # the single decode query (all QUERIES_PER_KV heads of one kv head, padded
    # to BLOCK_M >= 16 rows for tl.dot) to one slice of the context
    # (partition_size tokens, a runtime value so batch/context changes
    # do not recompile) and writes a partial (normalised out, max, sum-exp) for the
    # reduce kernel, so long contexts use many SMs even at batch 1.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    q_tok = tl.load(query_start_ptr + seq).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows  # [M]
    d = tl.arange(0, DIM_PAD).to(tl.int64)
    d_ok = d < head_dim
    d_k = d * stride_kc_d  # [DP] element offsets within a token's head row
    d_v = d * stride_vc_d
    q_off = q_tok * stride_q_t + head[:, None] * stride_q_h + d[None, :] * stride_q_d
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, DP]
    if DOT_FP32:
        q = q.to(tl.float32)

    # Partitions tile the keys the decode sees: from 0, or under a window
    # from seq_len - window (the decode at seq_len - 1 sees keys > its
    # position - window), so no program is spent on keys it cannot see.
    base = seq_len * 0
    if WINDOW:
        base = tl.maximum(seq_len - window, 0)
    part_start = base + part * partition_size
    part_end = tl.minimum(part_start + partition_size, seq_len)  # may be <= start: empty

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt_s
    for start in range(part_start, part_end, TILE_N):
        pos = start + tl.arange(0, TILE_N).to(tl.int64)  # [N]
        pos_ok = pos < part_end
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_bt_b, mask=pos_ok, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k_rows = k_cache_ptr + (block * stride_kc_b + in_block * stride_kc_t + kv_head * stride_kc_h)  # [N] ptrs
        v_rows = v_cache_ptr + (block * stride_vc_b + in_block * stride_vc_t + kv_head * stride_vc_h)
        k = tl.load(k_rows[:, None] + d_k[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_rows[:, None] + d_v[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = _scores(s, scale, softcap, SOFTCAP)  # [M, N]
        # The decode token is the sequence's last position: no causal mask
        # beyond "key position < seq_len".
        s = tl.where(pos_ok[None, :], s, NEG_BIG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.where(pos_ok[None, :], tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    po_off = seq * stride_po_s + head[:, None] * stride_po_h + part * stride_po_p + d[None, :]
    tl.store(part_o_ptr + po_off, acc, mask=row_ok[:, None] & d_ok[None, :])
    pm_off = seq * stride_pm_s + head * stride_pm_h + part
    tl.store(part_m_ptr + pm_off, m_i, mask=row_ok)
    tl.store(part_l_ptr + pm_off, l_i, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
    seq_lens_ptr, query_start_ptr, head_dim, partition_size, window,
    stride_o_t, stride_o_h, stride_o_d,
    stride_po_s, stride_po_h, stride_po_p,
    stride_pm_s, stride_pm_h,
    PARTS_CHUNK: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NEG_BIG: tl.constexpr,
    WINDOW: tl.constexpr,
):
    # grid: (seqs, heads). Combine partition partials: with M = max_p m_p,
    # out = sum_p w_p * o_p / sum_p w_p where w_p = l_p * 2^(m_p - M).
    # Only partitions that hold context are read (empty ones are skipped).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    q_tok = tl.load(query_start_ptr + seq).to(tl.int64)
    seen = seq_len
    if WINDOW:
        seen = tl.minimum(seq_len, window)  # keys the decode sees (the split kernel's partitions)
    num_parts = (seen + partition_size - 1) // partition_size
    pm_base = seq * stride_pm_s + head * stride_pm_h
    po_base = seq * stride_po_s + head * stride_po_h
    d = tl.arange(0, DIM_PAD).to(tl.int64)
    d_ok = d < head_dim

    # Pass 1: global max, in chunks so long contexts don't need a huge block.
    m_max = tl.full([PARTS_CHUNK], NEG_BIG, tl.float32)
    for p0 in range(0, num_parts, PARTS_CHUNK):
        p = p0 + tl.arange(0, PARTS_CHUNK).to(tl.int64)
        m = tl.load(part_m_ptr + pm_base + p, mask=p < num_parts, other=NEG_BIG)
        m_max = tl.maximum(m_max, m)
    m_all = tl.max(m_max, 0)

    # Pass 2: weighted sum of the partial outputs.
    acc = tl.zeros([DIM_PAD], tl.float32)
    w_sum = tl.zeros([PARTS_CHUNK], tl.float32)
    for p0 in range(0, num_parts, PARTS_CHUNK):
        p = p0 + tl.arange(0, PARTS_CHUNK).to(tl.int64)
        p_ok = p < num_parts
        m = tl.load(part_m_ptr + pm_base + p, mask=p_ok, other=NEG_BIG)
        l = tl.load(part_l_ptr + pm_base + p, mask=p_ok, other=0.0)
        w = tl.where(p_ok, l * tl.exp2(m - m_all), 0.0)  # [PC]
        o = tl.load(part_o_ptr + po_base + p[:, None] * stride_po_p + d[None, :],
                    mask=p_ok[:, None] & d_ok[None, :], other=0.0)  # [PC, DP]
        acc += tl.sum(o * w[:, None], 0)
        w_sum += w
    total = tl.sum(w_sum, 0)
    acc = acc / tl.where(total > 0, total, 1.0)
    o_off = q_tok * stride_o_t + head * stride_o_h + d * stride_o_d
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class _TileConfig:
    block_m: int  # rows per program (query tokens x heads of a kv group)
    tile_n: int  # KV tokens per inner iteration
    num_warps: int


def _tile_config(dim_pad: int, qpk_pad: int) -> _TileConfig:
    # tl.dot needs every dimension >= 16. head_dim 256 halves the tiles to
    # keep q/acc/K/V tiles within registers.
    block_m = 64 if dim_pad <= 128 else 32
    tile_n = 64 if dim_pad <= 128 else 32
    return _TileConfig(block_m=max(block_m, qpk_pad, 16), tile_n=tile_n, num_warps=4)


def decode_partition_size(
    num_seqs: int, num_kv_heads: int, max_context: int, tile_n: int, target_programs: int = 512
) -> int:
    """Tokens per flash-decoding partition, from shapes only (no device sync).

    Aim for ~target_programs (a few waves on an H100's 132 SMs) split-KV
    programs; never below 4 tiles so each program amortises its q load and
    the reduce stays cheap. Always a power of two multiple of tile_n.
    """
    programs = max(1, num_seqs * num_kv_heads)
    parts = max(1, -(-target_programs // programs))
    size = next_pow2(max(1, -(-max_context // parts)))
    return max(size, 4 * tile_n)


def paged_attention_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
    *,
    split_decode: Optional[bool] = None,
    partition_size: Optional[int] = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """paged_attention with knobs for tests/benchmarks.

    split_decode: None = flash-decoding iff the batch is decode-only
    (T == S); False forces the query-tiled kernel. partition_size overrides
    the heuristic (power of two, multiple of the KV tile).
    """
    check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    check_float_dtype(q, "q")
    assert q.dim() == 3, f"q must be [T, H, D], got {tuple(q.shape)}"
    num_tokens, num_heads, q_dim = q.shape
    assert q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}"
    assert q.device == k_cache.device, f"q on {q.device}, cache on {k_cache.device}"
    assert q_dim == head_dim, f"q head_dim {q_dim} != cache head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert block_tables.dim() == 2, f"block_tables must be [S, MB], got {tuple(block_tables.shape)}"
    num_seqs, max_blocks = block_tables.shape
    check_index(block_tables, "block_tables", q.device)
    check_index(seq_lens, "seq_lens", q.device, shape=(num_seqs,))
    check_index(query_start_loc, "query_start_loc", q.device, shape=(num_seqs + 1,))
    assert num_tokens >= num_seqs, "every sequence needs at least one query token"
    if out is None:
        out = torch.empty_like(q)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, (
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device}"
        )
    if num_tokens == 0:
        return out
    seq_lens = seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()

    qpk = num_heads // num_kv_heads
    dim_pad = max(16, next_pow2(head_dim))
    cfg = _tile_config(dim_pad, next_pow2(qpk))
    # The interpreter computes bf16/fp16 arithmetic and dots wrongly, so it
    # upcasts tiles right after loading; on GPU, fp32 caches also use fp32
    # (IEEE) dots, half types use tensor-core dots with fp32 accumulation.
    interpreted = is_interpreted(_prefill_kernel)
    dot_fp32 = interpreted or q.dtype == torch.float32
    launch_opts = {} if interpreted else {"num_warps": cfg.num_warps}
    assert window is None or window >= 1, f"window must be >= 1 or None, got {window}"
    assert softcap is None or softcap >= 0, f"softcap must be >= 0 or None, got {softcap}"
    common = dict(BLOCK_SIZE=block_size, DIM_PAD=dim_pad, DOT_FP32=dot_fp32, NEG_BIG=_NEG_BIG,
                  WINDOW=window is not None, SOFTCAP=bool(softcap))
    win, cap = int(window or 0), float(softcap or 1.0)

    if split_decode is None:
        split_decode = num_tokens == num_seqs
    if split_decode:
        assert num_tokens == num_seqs, "split decode needs exactly one query token per sequence"
        max_context = max_blocks * block_size
        if window is not None:  # partitions tile the window only
            max_context = min(max_context, window)
        part = partition_size or decode_partition_size(num_seqs, num_kv_heads, max_context, cfg.tile_n)
        assert part % cfg.tile_n == 0 and part & (part - 1) == 0, (
            f"partition_size {part} must be a power of two multiple of {cfg.tile_n}"
        )
        num_parts = triton.cdiv(max_context, part)
        block_m = max(16, next_pow2(qpk))
        # partials: o [S, H, P, DP], m and l [S, H, P]; fp32 whatever q's dtype.
        part_o = torch.empty((num_seqs, num_heads, num_parts, dim_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        _decode_split_kernel[(num_seqs, num_kv_heads, num_parts)](
            q, k_cache, v_cache, part_o, part_m, part_l,
            block_tables, seq_lens, query_start_loc,
            float(scale), head_dim, part, win, cap,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
            *part_o.stride()[:3], *part_m.stride()[:2],
            QUERIES_PER_KV=qpk, BLOCK_M=block_m, TILE_N=cfg.tile_n,
            **common, **launch_opts,
        )
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_o, part_m, part_l, seq_lens, query_start_loc, head_dim, part, win,
            *out.stride(), *part_o.stride()[:3], *part_m.stride()[:2],
            PARTS_CHUNK=min(32, next_pow2(num_parts)),
            DIM_PAD=dim_pad, NEG_BIG=_NEG_BIG, WINDOW=window is not None, **launch_opts,
        )
        return out

    qpk_pad = next_pow2(qpk)
    block_q = cfg.block_m // qpk_pad
    # Upper bound on tiles (see the kernel's tile -> sequence search); spare
    # tiles find no query rows and exit after the search.
    num_tiles = num_tokens // block_q + num_seqs
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        float(scale), num_seqs, head_dim, win, cap,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        QUERIES_PER_KV=qpk, QPK_PAD=qpk_pad, BLOCK_Q=block_q, BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n, **common, **launch_opts,
    )
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention of the new tokens q: [T, H, D] -> [T, H, D].

    Decode-only batches (one query per sequence) use flash-decoding; any
    other mix (prefill chunks with cached prefixes plus decodes) uses the
    query-tiled kernel. New tokens' K/V must already be in the cache.
    ``window`` / ``softcap``: as ``kvpager_kernels.reference.paged_attention``.
    """
    return paged_attention_impl(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
        window=window, softcap=softcap,
    )
