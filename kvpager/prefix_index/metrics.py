"""Metrics of prefix scoring from the mirror (any process that scores: routers, benchmarks)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from kvpager.telemetry import registry

# Scoring happens in the gateway (its router); benchmarks read the same registry.
REG = registry("gateway")

SCORE_LOOKUPS = Counter("kvpager_mirror_score_lookups_total", "Prefix scores answered from Redis.", registry=REG)
SCORE_LATENCY = Histogram("kvpager_mirror_score_seconds", "Prefix score round trip (client side).",
                          buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25), registry=REG)
