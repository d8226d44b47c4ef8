"""BatchHistogram (the inter-token latency's) exposes exactly what
prometheus_client's Histogram does for the same observations, bucket edges
included."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import BatchHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def samples(reg: CollectorRegistry) -> dict:
    (fam,) = [f for f in text_string_to_metric_families(generate_latest(reg).decode()) if f.name == "h"]
    assert fam.type == "histogram"
    return {(s.name, s.labels.get("le")): s.value for s in fam.samples if not s.name.endswith("_created")}


def test_same_exposition_as_the_reference_histogram():
    rng = random.Random(0)
    values = [rng.choice(BUCKETS) for _ in range(50)] + [rng.uniform(0, 2) for _ in range(500)] + [5.0, 0.0]
    ref_reg, fast_reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("h", "doc", buckets=BUCKETS, registry=ref_reg)
    fast = BatchHistogram("h", "doc", BUCKETS, fast_reg)
    for v in values:
        ref.observe(v)
    fast.observe_many(values[:100])
    fast.observe_many([])
    fast.observe_many(values[100:])
    got, want = samples(fast_reg), samples(ref_reg)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) < 1e-9, key
