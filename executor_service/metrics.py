"""Executor Prometheus metrics, in the executor's registry, defined once at import (several
executors may share a process in tests; they are told apart by the ``executor_id`` label).
The gRPC server's own RPC metrics live in ``kvpager.telemetry``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kvpager.telemetry import registry

REG = registry("executor")

STEPS = Counter("kvpager_executor_steps_total", "Execute steps run.", ["executor_id"], registry=REG)
TOKENS_COMPUTED = Counter(
    "kvpager_executor_tokens_computed_total", "Tokens run through the model (prefill + decode).", ["executor_id"]
, registry=REG)
TOKENS_SAMPLED = Counter("kvpager_executor_tokens_sampled_total", "Tokens sampled.", ["executor_id"], registry=REG)
CACHE_OPS = Counter(
    "kvpager_executor_cache_op_blocks_total", "Blocks moved by cache ops.", ["executor_id", "op"]
, registry=REG)
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FORWARD_SECONDS = Histogram(
    "kvpager_executor_forward_seconds", "Model forward time per step.", ["executor_id"], buckets=_BUCKETS
, registry=REG)
SAMPLE_SECONDS = Histogram(
    "kvpager_executor_sample_seconds", "Sampling time per step.", ["executor_id"], buckets=_BUCKETS
, registry=REG)
POOL_BYTES = Gauge("kvpager_executor_pool_bytes", "Bytes held by the KV pools.", ["executor_id", "pool"], registry=REG)
POOL_HUGE_BYTES = Gauge(
    "kvpager_executor_pool_huge_page_bytes", "Bytes of the device KV pool backed by transparent huge pages at "
    "startup (CPU; executor_service.huge_pages).", ["executor_id"], registry=REG)
POOL_BLOCKS = Gauge("kvpager_executor_pool_blocks", "Blocks in the KV pools.", ["executor_id", "pool"], registry=REG)
STEP_THREADS = Counter(
    "kvpager_executor_step_threads_total", "Steps run, by the intra-op thread count the CPU tuner chose for them.",
    ["executor_id", "threads"], registry=REG)
THREADS_BOUND = Gauge(
    "kvpager_executor_step_threads_bound", "1 while the CPU step threads run bound one per core "
    "(executor_service.cpu.CoreBinding), else 0.", ["executor_id"], registry=REG)
BURSTS_CUT = Counter("kvpager_executor_bursts_cut_total",
                     "Decode bursts cut short because a step was waiting behind them.", ["executor_id"], registry=REG)
SUB_STEPS_CARRIED = Counter(
    "kvpager_executor_sub_steps_carried_total",
    "Cut bursts' next sub-steps computed in the forward of the step that cut them.", ["executor_id"], registry=REG)
FAILED_STEPS = Counter("kvpager_executor_failed_steps_total", "Steps that failed after validation.", ["executor_id", "reason"], registry=REG)
FORWARDS = Counter(
    "kvpager_executor_forwards_total", "Model forwards, by how they ran: a replayed decode CUDA graph, eagerly, "
    "or stopped between layers (a burst cut during the forward).",
    ["executor_id", "mode"], registry=REG)
CUDA_GRAPHS = Gauge(
    "kvpager_executor_cuda_graphs", "Decode batch sizes captured as CUDA graphs (0: every step runs eagerly).",
    ["executor_id"], registry=REG)
