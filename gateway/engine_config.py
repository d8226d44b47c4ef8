"""The engine's settings (``gateway.cli`` fills them from flags, tests and
tools from their arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.params import RequestCaps
from gateway.recovery import RecoveryConfig


@dataclass
class EngineConfig:
    max_batch_tokens: int = 2048     # tokens each executor computes per step (prefill chunks + decodes)
    max_running: int = 64            # sequences each executor runs per step
    max_waiting: int = 1024          # requests admitted but not finished
    max_n: int = 8
    policy: str = "priority"         # a gateway.scheduling policy name: "priority" (default) | "fcfs"
    step_timeout_s: float = 120.0
    executor_refresh_s: float = 2.0
    executor_info_timeout_s: float = 2.0  # an executor's GetInfo when it joins (then retried with backoff)
    load_weight_tokens: float = 16.0  # routing: one queued sequence costs this many prefix tokens
    max_prompt_tokens: int = 0       # longest prompt accepted; 0 = max_model_len - 1
    stream_interval: int = 1         # tokens per streamed delta for requests that set none
    # Plan each executor's next step while its current one runs, decodes fed
    # with the executor's own samples (hides the Step and Execute round trips).
    plan_ahead: bool = True
    # Decode bursts (gateway.bursts): up to this many tokens per step for requests that do not
    # stream every token, each burst at most max_burst_ms of the executor's measured forwards.
    num_scheduler_steps: int = 8
    max_burst_ms: float = 30.0
    # A step planned while a burst runs on its executor (a request arrived) cuts that burst short.
    cut_bursts: bool = True
    # With plan_ahead, a burst's next step is planned this long (at least one forward) before the
    # burst should end (gateway.inflight.bursts_running); 0: after the burst returns.
    burst_plan_lead_ms: float = 6.0
    # With plan_ahead, the step planned ahead behind a running prefill waits while requests still
    # arrive (the latest this recently) and it is not full (gateway.arrivals); 0: planned at once.
    arrival_settle_ms: float = 3.0
    caps: RequestCaps = field(default_factory=RequestCaps)  # what one request may ask (docs/security.md)
    # Streams that outlive a lost memory service or executor (gateway/recovery.py).
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
