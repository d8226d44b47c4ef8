"""The memory service's Prometheus metrics, in its own registry
(``kvpager.telemetry.registry("memory")``); docs/metrics.md lists each one
beside the vLLM metric it corresponds to.

Step-path metrics are plain counters and histograms. The block accounting is
a collector computed at scrape time (O(blocks held), never on the Step
path): gauges per executor for what the pool holds now, and counters for
what it has done (from the pool's own cumulative counts, so a re-registered
executor starts again from 0, which Prometheus' ``rate`` reads as a reset).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpager.telemetry import registry

REGISTRY = registry("memory")

STEP_LATENCY = Histogram("kvpager_memory_step_seconds", "In-process Step planning time.", registry=REGISTRY,
                         buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1))
STEP_SEQS = Counter("kvpager_memory_scheduled_sequences_total", "Sequences scheduled across all steps.",
                    registry=REGISTRY)

# name, help, PoolAccounting attribute (or a function of it)
GAUGES = (
    ("kvpager_kv_cache_usage_perc", "Fraction of the pool's blocks in use (refcount > 0), 0..1.",
     lambda p: p.used_blocks / p.total_blocks if p.total_blocks else 0.0),
    ("kvpager_kv_total_blocks", "Blocks in the device pool.", "total_blocks"),
    ("kvpager_kv_free_blocks", "Blocks an allocation may take (cached-evictable ones included).", "free_blocks"),
    ("kvpager_kv_used_blocks", "Blocks with refcount > 0.", "used_blocks"),
    ("kvpager_kv_cached_evictable_blocks", "Free blocks still findable by prefix hash (evicted LRU first).",
     "cached_blocks"),
    ("kvpager_kv_live_tokens", "Token slots holding KV (each physical block once).", "live_tokens"),
    ("kvpager_kv_allocated_slots", "Token slots of the blocks in use (used blocks x block size).",
     "allocated_slots"),
    ("kvpager_kv_token_occupancy_ratio", "Live tokens / the pool's token slots: token-level twin of "
     "kv_cache_usage_perc, 0..1.", "token_occupancy"),
    ("kvpager_kv_block_fill_ratio", "Live tokens / slots of the used blocks (how full allocated blocks are).",
     "kv_utilization"),
    ("kvpager_kv_internal_waste_slots", "Allocated slots holding no token (partial tail blocks).",
     lambda p: p.allocated_slots - p.live_tokens),
    ("kvpager_kv_logical_blocks", "Sum of the block tables' lengths.", "logical_blocks"),
    ("kvpager_kv_physical_blocks", "Distinct blocks the block tables hold.", "physical_blocks"),
    ("kvpager_kv_sharing_saved_blocks", "Blocks sharing saves: logical - physical.", "sharing_saved_blocks"),
    ("kvpager_kv_contiguous_equivalent_blocks",
     "Blocks a contiguous max-context reservation (the seeds') would need for the sequences holding KV now.",
     "contiguous_equivalent_blocks"),
    ("kvpager_kv_contiguous_declared_blocks",
     "Blocks a contiguous reservation of prompt + max_tokens (request-declared) would need for them.",
     "contiguous_declared_blocks"),
    ("kvpager_kv_pinned_blocks", "Prompt blocks retained for requests that asked (retention_s), pins unexpired.",
     "pinned_blocks"),
    ("kvpager_kv_running_sequences", "Sequences holding device blocks.", "num_sequences"),
    ("kvpager_kv_swapped_sequences", "Sequences swapped out to the CPU pool.", "num_swapped_sequences"),
    ("kvpager_kv_swap_total_blocks", "Blocks in the CPU swap pool.", "swap_total_blocks"),
    ("kvpager_kv_swap_free_blocks", "Free blocks in the CPU swap pool.", "swap_free_blocks"),
)
COUNTERS = (
    ("kvpager_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first admissions).",
     "prefix_query_tokens"),
    ("kvpager_prefix_cache_hits", "Prompt tokens found in the prefix cache (first admissions).",
     "prefix_hit_tokens"),
    ("kvpager_prefix_cache_recompute_queries", "Tokens to compute again at re-admissions after preemption by "
     "recompute (not in kvpager_prefix_cache_queries).", "recompute_query_tokens"),
    ("kvpager_prefix_cache_recompute_hits", "Of those, tokens the cache still held.", "recompute_hit_tokens"),
    ("kvpager_kv_copy_on_write_copies", "Blocks copied because a shared block was written.",
     "copy_on_write_copies"),
    ("kvpager_kv_evictions", "Cached free blocks reused for new data (their prefix entry dropped).", "evictions"),
)


def _value(p, attr) -> float:
    return float(attr(p) if callable(attr) else getattr(p, attr))


class AccountingCollector(Collector):
    """One memory service's block accounting (``state.manager.accounting()``)."""

    def __init__(self, state) -> None:
        self.state = state

    def collect(self):
        _, parts = self.state.manager.accounting()
        for name, doc, attr in GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["executor"])
            for p in parts:
                g.add_metric([p.executor_id], _value(p, attr))
            yield g
        for name, doc, attr in COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["executor"])
            for p in parts:
                c.add_metric([p.executor_id], _value(p, attr))
            yield c
        pre = CounterMetricFamily("kvpager_num_preemptions", "Sequences preempted, by mode (recompute | swap).",
                                  labels=["executor", "mode"])
        swaps = CounterMetricFamily("kvpager_kv_swapped_blocks", "Blocks moved between the device and the CPU "
                                    "swap pool, by direction (out | in).", labels=["executor", "direction"])
        for p in parts:
            pre.add_metric([p.executor_id, "recompute"], p.preemptions_recompute)
            pre.add_metric([p.executor_id, "swap"], p.preemptions_swap)
            swaps.add_metric([p.executor_id, "out"], p.swapped_out_blocks)
            swaps.add_metric([p.executor_id, "in"], p.swapped_in_blocks)
        yield pre
        yield swaps


class _CollectorSet(Collector):
    """One registered collector fanning out to the newest live MemoryState in
    the process (tests run several; a registry accepts a name only once)."""

    def __init__(self) -> None:
        self._members: list[AccountingCollector] = []
        REGISTRY.register(self)

    def attach(self, c: AccountingCollector) -> None:
        self._members.append(c)

    def detach(self, c: AccountingCollector) -> None:
        if c in self._members:
            self._members.remove(c)

    def describe(self):
        return []

    def collect(self):
        if self._members:
            yield from self._members[-1].collect()


COLLECTORS = _CollectorSet()

BLOCKMAP_VIEWERS = Gauge("kvpager_blockmap_viewers", "Block map streams open now.", registry=REGISTRY)
BLOCKMAP_UPDATE_BYTES = Histogram("kvpager_blockmap_update_bytes", "Bytes of one block map update (JSON).",
                                  registry=REGISTRY,
                                  buckets=(256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304))
