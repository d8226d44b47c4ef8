"""The mirror writer's and recovery's Prometheus metrics, defined once at import (several
writers may live in one process; they share these). Scoring metrics: kvpager.prefix_index.metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from kvpager.telemetry import registry

REG = registry("memory")

EVENTS_APPLIED = Counter("kvpager_mirror_events_applied_total", "KV events written to the Redis mirror.", registry=REG)
BATCHES = Counter("kvpager_mirror_batches_total", "Script calls (flushes and resync chunks) sent to Redis.", registry=REG)
LAG_EVENTS = Gauge("kvpager_mirror_lag_events", "KV events emitted but not yet reflected in Redis.", registry=REG)
ERRORS = Counter("kvpager_mirror_errors_total", "Mirror failures by kind (redis, gap, stale, missing).", ["kind"], registry=REG)
STALE = Gauge("kvpager_mirror_stale", "1 while the Redis mirror is behind the in-process index (down, resyncing).", registry=REG)
RESYNCS = Counter("kvpager_mirror_resyncs_total", "Full per-executor resyncs started.", registry=REG)
RECOVERED = Counter("kvpager_mirror_recovery_total", "Executors seen at restart recovery by outcome.", ["outcome"], registry=REG)
RECOVERED_BLOCKS = Counter("kvpager_mirror_recovered_blocks_total", "Cached blocks rebuilt from the mirror.", registry=REG)
FENCED_BLOCKS = Counter("kvpager_mirror_recovery_left_out_blocks_total",
                        "Mirrored blocks left out at recovery: written by steps the mirror never saw (or chained "
                        "through such a block).", registry=REG)
