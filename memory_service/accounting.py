"""Live block accounting and the invariants behind it.

The seeds' whole argument made visible: how many blocks are used, how full
they are, how much sharing saves, how often prefixes hit, and what a
contiguous reservation would have needed for the same sequences.
Computed on demand (O(blocks held)); never on the allocation path.

Figures that read alike are kept apart so none can be misread for another:

* ``block_usage`` (used blocks / pool blocks) beside ``token_occupancy``
  (live tokens / pool token slots) and ``kv_utilization`` (live tokens /
  slots of the used blocks: the fill of what is allocated);
* ``prefix_hit_rate`` is over first prefills only; a re-admission after a
  preemption by recompute counts in ``recompute_*`` (its hits are the
  sequence finding its own blocks again, not sharing);
* ``preempt_*``: the mode policy's estimates summed over its decisions,
  beside the executor's measured rates they came from;
* ``pinned_blocks``: blocks retained for requests that asked (``retention_s``),
  pins not yet expired;
* two contiguous counterfactuals for the sequences holding KV:
  ``contiguous_equivalent_blocks`` reserves the full context per sequence
  (the seeds' worst case), ``contiguous_declared_blocks`` what each request
  declared (prompt + max_tokens, Orca's "max" setting).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from memory_service.costs import ExecutorCosts
from memory_service.kv_manager import ExecutorKV
from kvpager.seq_status import SeqStatus
from memory_service.sequence import Sequence


@dataclass(slots=True)
class PoolAccounting:
    executor_id: str = ""
    total_blocks: int = 0
    free_blocks: int = 0
    used_blocks: int = 0
    cached_blocks: int = 0
    live_tokens: int = 0
    allocated_slots: int = 0
    kv_utilization: float = 0.0
    block_usage: float = 0.0
    token_occupancy: float = 0.0
    logical_blocks: int = 0
    physical_blocks: int = 0
    sharing_saved_blocks: int = 0
    prefix_hit_rate: float = 0.0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    recompute_query_tokens: int = 0
    recompute_hit_tokens: int = 0
    recompute_hit_rate: float = 0.0
    preemptions: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    contiguous_equivalent_blocks: int = 0
    contiguous_declared_blocks: int = 0
    num_sequences: int = 0
    num_swapped_sequences: int = 0
    swap_total_blocks: int = 0
    swap_free_blocks: int = 0
    copy_on_write_copies: int = 0
    evictions: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    block_size: int = 0
    preempt_recompute_tokens: int = 0
    preempt_swap_bytes: int = 0
    preempt_cost_s: float = 0.0
    preempt_saved_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    swap_bytes_per_s: float = 0.0
    pinned_blocks: int = 0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def executor_accounting(kv: ExecutorKV, seqs: dict[int, Sequence], costs: ExecutorCosts | None = None,
                        pinned_blocks: int = 0) -> PoolAccounting:
    """One executor's figures; ``costs``: what it last measured (shown beside the estimates made from it)."""
    bs = kv.block_size
    pool = kv.pool
    filled: dict[int, int] = {}   # block id -> slots written (max over sharers)
    logical = 0
    running = swapped = 0
    declared = 0
    max_len = kv.spec.max_model_len or kv.spec.num_blocks * bs
    for seq_id in kv.seq_ids:
        seq = seqs[seq_id]
        if seq.status is SeqStatus.SWAPPED:
            swapped += 1
        if not seq.blocks:
            continue
        running += 1
        declared += _cdiv(seq.token_limit or max_len, bs)
        logical += len(seq.blocks)
        n = seq.num_computed
        for i, block in enumerate(seq.blocks):
            f = min(bs, max(0, n - i * bs))
            if f > filled.get(block.block_id, -1):
                filled[block.block_id] = f
    physical = len(filled)
    live = sum(filled.values())
    used = pool.num_blocks - pool.num_free
    c = kv.counters
    return PoolAccounting(
        executor_id=kv.spec.executor_id,
        total_blocks=pool.num_blocks,
        free_blocks=pool.num_free,
        used_blocks=used,
        cached_blocks=pool.num_cached_free,
        live_tokens=live,
        allocated_slots=used * bs,
        kv_utilization=live / (used * bs) if used else 0.0,
        block_usage=used / pool.num_blocks,
        token_occupancy=live / (pool.num_blocks * bs),
        logical_blocks=logical,
        physical_blocks=physical,
        sharing_saved_blocks=logical - physical,
        prefix_hit_rate=c.prefix_hit_tokens / c.prefix_query_tokens if c.prefix_query_tokens else 0.0,
        prefix_query_tokens=c.prefix_query_tokens,
        prefix_hit_tokens=c.prefix_hit_tokens,
        recompute_query_tokens=c.recompute_query_tokens,
        recompute_hit_tokens=c.recompute_hit_tokens,
        recompute_hit_rate=_ratio(c.recompute_hit_tokens, c.recompute_query_tokens),
        preemptions=c.preemptions_recompute + c.preemptions_swap,
        preemptions_recompute=c.preemptions_recompute,
        preemptions_swap=c.preemptions_swap,
        contiguous_equivalent_blocks=running * _cdiv(max_len, bs),
        contiguous_declared_blocks=declared,
        num_sequences=running,
        num_swapped_sequences=swapped,
        swap_total_blocks=kv.swap.num_blocks,
        swap_free_blocks=kv.swap.num_free,
        copy_on_write_copies=c.cow_copies,
        evictions=pool.num_evictions,
        swapped_out_blocks=c.swapped_out_blocks,
        swapped_in_blocks=c.swapped_in_blocks,
        block_size=bs,
        preempt_recompute_tokens=c.preempt_recompute_tokens,
        preempt_swap_bytes=c.preempt_swap_bytes,
        preempt_cost_s=c.preempt_cost_s,
        preempt_saved_s=c.preempt_saved_s,
        prefill_tokens_per_s=costs.prefill_tokens_per_s[-1] if costs and costs.prefill_tokens_per_s else 0.0,
        swap_bytes_per_s=costs.swap_bytes_per_s if costs else 0.0,
        pinned_blocks=pinned_blocks,
    )


_SUMMED = ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "live_tokens", "allocated_slots",
           "logical_blocks", "physical_blocks", "sharing_saved_blocks", "prefix_query_tokens", "prefix_hit_tokens",
           "recompute_query_tokens", "recompute_hit_tokens",
           "preemptions", "preemptions_recompute", "preemptions_swap", "contiguous_equivalent_blocks",
           "contiguous_declared_blocks",
           "num_sequences", "num_swapped_sequences", "swap_total_blocks", "swap_free_blocks",
           "copy_on_write_copies", "evictions", "swapped_out_blocks", "swapped_in_blocks",
           "preempt_recompute_tokens", "preempt_swap_bytes", "preempt_cost_s", "preempt_saved_s", "pinned_blocks")


def total_accounting(parts: list[PoolAccounting]) -> PoolAccounting:
    total = PoolAccounting()
    for part in parts:
        for name in _SUMMED:
            setattr(total, name, getattr(total, name) + getattr(part, name))
    sizes = {p.block_size for p in parts}
    total.block_size = sizes.pop() if len(sizes) == 1 else 0
    total.kv_utilization = _ratio(total.live_tokens, total.allocated_slots)
    total.block_usage = _ratio(total.used_blocks, total.total_blocks)
    total.token_occupancy = _ratio(total.live_tokens, sum(p.total_blocks * p.block_size for p in parts))
    total.prefix_hit_rate = _ratio(total.prefix_hit_tokens, total.prefix_query_tokens)
    total.recompute_hit_rate = _ratio(total.recompute_hit_tokens, total.recompute_query_tokens)
    return total


def check_invariants(kv: ExecutorKV, seqs: dict[int, Sequence]) -> list[str]:
    """Every violated invariant of one executor's pool, as text (empty = sound)."""
    bad: list[str] = []
    pool = kv.pool
    bs = kv.block_size
    queue = pool.free_queue.block_ids()
    if len(queue) != len(set(queue)):
        bad.append("a block is in the free queue twice")
    if len(queue) != pool.num_free:
        bad.append(f"free queue length {len(queue)} != num_free {pool.num_free}")
    holders: dict[int, int] = {}
    for seq_id in kv.seq_ids:
        seq = seqs.get(seq_id)
        if seq is None or seq.executor_id != kv.spec.executor_id:
            bad.append(f"sequence {seq_id} listed but not owned")
            continue
        for block in seq.blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
        if list(seq.block_ids) != [b.block_id for b in seq.blocks]:
            bad.append(f"seq {seq_id}: block_ids out of step with its blocks")
        if seq.status is SeqStatus.RUNNING:
            if len(seq.blocks) != _cdiv(seq.num_computed, bs):
                bad.append(f"seq {seq_id}: {len(seq.blocks)} blocks for {seq.num_computed} tokens")
        elif seq.blocks:
            bad.append(f"seq {seq_id} is {seq.status.value} but holds device blocks")
        if seq.status is SeqStatus.SWAPPED and len(seq.swap_blocks) != _cdiv(seq.num_computed, bs):
            bad.append(f"seq {seq_id}: {len(seq.swap_blocks)} swap blocks for {seq.num_computed} tokens")
        if seq.num_computed > seq.num_tokens:
            bad.append(f"seq {seq_id}: computed {seq.num_computed} > {seq.num_tokens} tokens")
        for i, block in enumerate(seq.blocks[: seq.num_computed // bs]):
            if block.token_ids is not None and list(block.token_ids) != seq.token_ids[i * bs:(i + 1) * bs]:
                bad.append(f"seq {seq_id}: cached block {block.block_id} holds other tokens")
    in_queue = set(queue)
    num_used = 0
    cached_free = 0
    for block in pool.blocks:
        if block.ref_cnt < 0:
            bad.append(f"block {block.block_id} refcount {block.ref_cnt}")
        if block.ref_cnt != holders.get(block.block_id, 0):
            bad.append(f"block {block.block_id} refcount {block.ref_cnt} != {holders.get(block.block_id, 0)} holders")
        if (block.ref_cnt == 0) != (block.block_id in in_queue):
            bad.append(f"block {block.block_id}: refcount {block.ref_cnt} but in_queue={block.block_id in in_queue}")
        if block.ref_cnt > 0:
            num_used += 1
        elif block.block_hash is not None:
            cached_free += 1
        if block.block_hash is not None and pool.cached.get(block.block_hash) is not block:
            bad.append(f"block {block.block_id} has a hash the index maps elsewhere")
    if num_used + pool.num_free != pool.num_blocks:
        bad.append(f"free {pool.num_free} + used {num_used} != total {pool.num_blocks}")
    if cached_free != pool.num_cached_free:
        bad.append(f"cached free count {pool.num_cached_free} != {cached_free}")
    for h, block in pool.cached.items():
        if block.block_hash != h:
            bad.append(f"index entry for block {block.block_id} does not match its hash")
    held_swap = sum(len(seqs[s].swap_blocks) for s in kv.seq_ids if s in seqs)
    if held_swap + kv.swap.num_free != kv.swap.num_blocks:
        bad.append(f"swap: held {held_swap} + free {kv.swap.num_free} != {kv.swap.num_blocks}")
    return bad
