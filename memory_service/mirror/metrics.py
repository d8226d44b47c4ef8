"""The mirror writer's and recovery's Prometheus metrics, defined once at import (several
writers may live in one process; they share these). Scoring metrics: kvpager.prefix_index.metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

EVENTS_APPLIED = Counter("kvpager_mirror_events_applied_total", "KV events written to the Redis mirror.")
BATCHES = Counter("kvpager_mirror_batches_total", "Script calls (flushes and resync chunks) sent to Redis.")
LAG_EVENTS = Gauge("kvpager_mirror_lag_events", "KV events emitted but not yet reflected in Redis.")
ERRORS = Counter("kvpager_mirror_errors_total", "Mirror failures by kind (redis, gap, stale, missing).", ["kind"])
STALE = Gauge("kvpager_mirror_stale", "1 while the Redis mirror is behind the in-process index (down, resyncing).")
RESYNCS = Counter("kvpager_mirror_resyncs_total", "Full per-executor resyncs started.")
RECOVERED = Counter("kvpager_mirror_recovery_total", "Executors seen at restart recovery by outcome.", ["outcome"])
RECOVERED_BLOCKS = Counter("kvpager_mirror_recovered_blocks_total", "Cached blocks rebuilt from the mirror.")
FENCED_BLOCKS = Counter("kvpager_mirror_recovery_left_out_blocks_total",
                        "Mirrored blocks left out at recovery: written by steps the mirror never saw (or chained "
                        "through such a block).")
