"""Policies: small one-method objects the mechanism consults. The pool and
the per-executor KV manager never choose; the planner asks these.

* ``VictimEligibility.eligible`` — may this running sequence give its blocks
  back so that the requester gets room?
* ``VictimPolicy.select`` — which of the eligible ones goes first
  (``LeastLostWorkVictimPolicy``: the one whose preemption wastes the least
  per block it frees).
* a mode policy's ``choose`` — recompute or swap, per victim, from a
  ``PreemptionEstimate`` (``estimate_preemption``: what each mode would cost
  at the executor's measured prefill throughput and copy bandwidth). Four:
  ``RecomputeModePolicy``, ``SwapModePolicy``, ``ThresholdModePolicy`` (the
  old fixed length rule) and ``CostModePolicy`` (the default: the cheaper
  mode by measured cost). Each returns a ``PreemptionDecision`` saying why.
* ``EvictionPolicy.tier`` — which cached-but-free blocks are evicted first
  (the pool pops the lowest tier, least recently freed first within it;
  ``RetentionEvictionPolicy``: retained prefixes after all others).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvpager.seq_status import SeqStatus
from memory_service.block import Block
from memory_service.costs import ExecutorCosts
from memory_service.sequence import Sequence


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class VictimEligibility:
    """A running sequence that cannot grow may push back any running sequence
    not yet served in this step (itself included: it then waits). A waiting or
    swapped one being admitted may push back only strictly less important
    ones (equal priorities never preempt for admission, so the pool cannot
    thrash)."""

    def eligible(self, candidate: Sequence, requester: Sequence) -> bool:
        if requester.status is SeqStatus.RUNNING:
            return True
        return candidate.priority > requester.priority


# ---- what a preemption would cost ---------------------------------------------------


@dataclass(slots=True)
class PreemptionEstimate:
    """Both modes' cost for one victim. ``recompute_tokens``: computed tokens
    that will not be prefix hits at resume (its full blocks stay in the
    cached free queue unless the room being made evicts them); ``*_s``: at
    the executor's measured rates (None: not measured yet).

    ``unshared_blocks``: leading blocks it holds with other sequences that a
    recompute takes back as prefix hits but a swap copies out (freeing
    nothing) and back into private blocks, so after a swap-in the pool holds
    them twice for the rest of the sequence. ``unshare_s`` prices that: the
    prefill of as many tokens, what the pool pays to get the blocks back
    from someone else by recompute (the benchmark measured a swap of a
    shared prefix losing to its recompute although its copy was far
    cheaper)."""

    recompute_tokens: int
    recompute_s: float | None
    swap_blocks: int
    swap_bytes: int
    swap_s: float | None      # out now + in at resume
    swap_fits: bool           # the CPU swap pool has room for all its blocks
    freed_blocks: int         # device blocks this preemption gives back (shared ones stay held)
    unshared_blocks: int = 0
    unshare_s: float | None = 0.0

    @property
    def swap_total_s(self) -> float | None:
        """A swap's whole cost: the copies and the sharing it loses."""
        if self.swap_s is None or self.unshare_s is None:
            return None
        return self.swap_s + self.unshare_s

    def cost_s(self, mode: PreemptionMode) -> float | None:
        return self.swap_total_s if mode is PreemptionMode.SWAP else self.recompute_s


@dataclass(slots=True)
class PreemptionDecision:
    seq_id: int
    mode: PreemptionMode
    reason: str
    estimate: PreemptionEstimate


def estimate_preemption(victim: Sequence, block_size: int, swap_free_blocks: int, costs: ExecutorCosts | None,
                        taken_blocks: int = 0) -> PreemptionEstimate:
    """``taken_blocks``: how many blocks the requester will take beyond what
    is free now, i.e. out of the victim's own freed blocks. The pool queues
    a freed sequence tail first, so those go from its tail: a leading cached
    block survives unless the taking reaches it."""
    blocks = victim.blocks
    private = [i for i, b in enumerate(blocks) if b.ref_cnt == 1]  # freed by the preemption
    taken = set(private[::-1][:taken_blocks])
    max_hits = (max(victim.num_tokens, 1) - 1) // block_size  # the last token is always recomputed
    hits = unshared = 0
    # A table per KV group: group 0's table by position (a hole, where a window passed, ends the estimate).
    by_position = victim.kv_groups.tables[0] if victim.kv_groups is not None else blocks
    for i, b in enumerate(by_position[:min(max_hits, victim.num_computed // block_size)]):
        if b is None or b.block_hash is None or (by_position is blocks and i in taken):
            break
        hits += 1
        unshared += b.ref_cnt > 1
    recompute_tokens = max(0, victim.num_computed - hits * block_size)
    n = len(blocks)
    block_bytes = costs.block_bytes if costs is not None else 0
    return PreemptionEstimate(
        recompute_tokens=recompute_tokens,
        recompute_s=costs.prefill_s(recompute_tokens) if costs is not None else None,
        swap_blocks=n, swap_bytes=n * block_bytes,
        swap_s=costs.swap_s(n) if costs is not None else None,
        swap_fits=n <= swap_free_blocks, freed_blocks=len(private), unshared_blocks=unshared,
        unshare_s=costs.prefill_s(unshared * block_size) if costs is not None else None)


class ModePolicy(Protocol):
    name: str

    def choose(self, victim: Sequence, est: PreemptionEstimate) -> PreemptionDecision:
        """Recompute or swap this victim, and why."""


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


class RecomputeModePolicy:
    """Always recompute (vLLM's only mode)."""

    name = "recompute"

    def choose(self, victim: Sequence, est: PreemptionEstimate) -> PreemptionDecision:
        return PreemptionDecision(victim.seq_id, PreemptionMode.RECOMPUTE, "always recompute", est)


class SwapModePolicy:
    """Swap whenever the CPU swap pool has room; recompute otherwise."""

    name = "swap"

    def choose(self, victim: Sequence, est: PreemptionEstimate) -> PreemptionDecision:
        if est.swap_fits:
            return PreemptionDecision(victim.seq_id, PreemptionMode.SWAP, "always swap", est)
        return PreemptionDecision(victim.seq_id, PreemptionMode.RECOMPUTE, "swap pool full", est)


@dataclass
class ThresholdModePolicy:
    """The fixed length rule: swap when the victim has at least
    ``swap_min_tokens`` computed tokens and the swap pool has room."""

    swap_min_tokens: int = 256
    name = "threshold"

    def choose(self, victim: Sequence, est: PreemptionEstimate) -> PreemptionDecision:
        if not est.swap_fits:
            return PreemptionDecision(victim.seq_id, PreemptionMode.RECOMPUTE, "swap pool full", est)
        if victim.num_computed >= self.swap_min_tokens:
            return PreemptionDecision(victim.seq_id, PreemptionMode.SWAP,
                                      f"{victim.num_computed} tokens >= swap_min_tokens {self.swap_min_tokens}", est)
        return PreemptionDecision(victim.seq_id, PreemptionMode.RECOMPUTE,
                                  f"{victim.num_computed} tokens < swap_min_tokens {self.swap_min_tokens}", est)


@dataclass
class CostModePolicy:
    """The cheaper mode at the executor's measured rates: recompute costs the
    prefill of the tokens that will not be prefix hits at resume, swap the
    copy of all its blocks out and back in plus the sharing it loses
    (``PreemptionEstimate.unshare_s``). Ties go to recompute (it keeps
    the swap pool and the host link free). Until the executor has measured
    both rates, ``fallback`` decides (and the reason says so)."""

    fallback: ModePolicy = None  # type: ignore[assignment]
    name = "cost"

    def __post_init__(self) -> None:
        if self.fallback is None:
            self.fallback = ThresholdModePolicy()

    def choose(self, victim: Sequence, est: PreemptionEstimate) -> PreemptionDecision:
        if not est.swap_fits:
            return PreemptionDecision(victim.seq_id, PreemptionMode.RECOMPUTE, "swap pool full", est)
        swap_s = est.swap_total_s
        if est.recompute_s is None or swap_s is None:
            d = self.fallback.choose(victim, est)
            d.reason = f"unmeasured, {self.fallback.name}: {d.reason}"
            return d
        swap = f"swap {_ms(swap_s)}" + (f" ({est.unshared_blocks} shared blocks {_ms(est.unshare_s)})"
                                        if est.unshared_blocks else "")
        if swap_s < est.recompute_s:
            return PreemptionDecision(victim.seq_id, PreemptionMode.SWAP,
                                      f"{swap} < recompute {_ms(est.recompute_s)}", est)
        return PreemptionDecision(victim.seq_id, PreemptionMode.RECOMPUTE,
                                  f"recompute {_ms(est.recompute_s)} <= {swap}", est)


MODE_POLICIES = ("cost", "threshold", "recompute", "swap")


def make_mode_policy(name: str, swap_min_tokens: int = 256) -> ModePolicy:
    threshold = ThresholdModePolicy(swap_min_tokens)
    policies = {"cost": CostModePolicy(threshold), "threshold": threshold, "recompute": RecomputeModePolicy(),
                "swap": SwapModePolicy()}
    try:
        return policies[name]
    except KeyError:
        raise ValueError(f"preemption mode policy must be one of {list(MODE_POLICIES)}, got {name!r}") from None


# ---- who goes first ---------------------------------------------------------------------


class VictimPolicy:
    """Which eligible running sequence gives its blocks back: the least
    important (highest priority value), and among equals the newest arrival —
    the sequence that has had the least service loses the least work."""

    name = "newest"

    def select(self, candidates: Iterable[Sequence],
               lost_work: Callable[[Sequence], PreemptionEstimate] | None = None) -> Sequence | None:
        return max(candidates, key=lambda s: (s.priority, s.arrival), default=None)


class LeastLostWorkVictimPolicy(VictimPolicy):
    """Among the least important, the one whose preemption wastes the least
    per block it frees (at its cheaper mode's estimated seconds; where the
    rates are unmeasured, its tokens to recompute), newest arrival among
    equals. A victim that frees nothing (all its blocks shared) goes last."""

    name = "least-lost-work"

    def select(self, candidates: Iterable[Sequence],
               lost_work: Callable[[Sequence], PreemptionEstimate] | None = None) -> Sequence | None:
        candidates = list(candidates)
        if not candidates:
            return None
        worst = max(s.priority for s in candidates)
        pool = [s for s in candidates if s.priority == worst]
        if lost_work is None:
            return max(pool, key=lambda s: s.arrival)

        def waste(s: Sequence) -> tuple:
            est = lost_work(s)
            if not est.freed_blocks:
                return (1, 0.0, -s.arrival)
            costs = [c for c in (est.recompute_s, est.swap_total_s if est.swap_fits else None) if c is not None]
            lost = min(costs) if costs else float(est.recompute_tokens)
            return (0, lost / est.freed_blocks, -s.arrival)

        return min(pool, key=waste)


VICTIM_POLICIES = {cls.name: cls for cls in (VictimPolicy, LeastLostWorkVictimPolicy)}


# ---- tenants ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """The most blocks of one pool a tenant's sequences may hold at once:
    ``max_blocks`` below 1 is a fraction of the pool, from 1 up a count.
    With a quota, a tenant at its quota preempts only its own sequences to
    grow, and no tenant's sequences are preempted for another's (so a
    tenant flooding the pool cannot push another below its quota)."""

    max_blocks: float

    def __post_init__(self) -> None:
        if not self.max_blocks > 0:
            raise ValueError(f"tenant quota must be > 0 (a fraction below 1, else a block count), got "
                             f"{self.max_blocks}")

    def cap(self, pool_blocks: int) -> int:
        if self.max_blocks < 1:
            return max(1, int(self.max_blocks * pool_blocks))
        return min(pool_blocks, int(self.max_blocks))


# ---- eviction order -----------------------------------------------------------------------


class EvictionPolicy:
    """Eviction order of free blocks: every block in one tier, so the pool
    evicts least recently freed first (LRU). A policy with more tiers sends
    some blocks behind others (say, retained prefixes after the rest);
    ``tiers`` says how many, ``tier(block)`` is asked when a block is freed."""

    tiers = 1

    def tier(self, block: Block) -> int:
        return 0


class RetentionEvictionPolicy(EvictionPolicy):
    """Retained prefixes last: a block whose pin (``Block.retain_until``) has
    not expired when it is freed joins tier 1, evicted only once no unpinned
    free block is left; LRU within each tier. A soft pin: an allocation never
    fails while free blocks remain."""

    tiers = 2

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock

    def tier(self, block: Block) -> int:
        return 1 if block.retain_until > self.clock() else 0
