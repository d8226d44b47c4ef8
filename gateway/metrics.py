"""The gateway's Prometheus metrics, in its own registry
(``kvpager.telemetry.registry("gateway")``), defined once per process.

The request-level families carry vLLM's meanings under our prefix
(docs/metrics.md lists each beside its vLLM name); the ``kvpager_gateway_*``
ones are the engine loop's own. Histogram buckets are vLLM's, extended
downwards where a CPU demo model answers in milliseconds.
"""

import threading

import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from kvpager.telemetry import registry

REGISTRY = registry("gateway")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)



class BatchHistogram(Collector):
    """A histogram observed a batch at a time (numpy bucketing): the
    inter-token latency gets one value per running request per step, and
    ``Histogram.observe`` one by one (a lock and a Python loop each) cost the
    engine loop ~3 us a request."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry) -> None:
        self.name, self.documentation = name, documentation
        self._bounds = np.asarray(buckets, dtype=np.float64)
        self._counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values) -> None:
        v = np.asarray(values, dtype=np.float64)
        if not v.size:
            return
        counts = np.bincount(np.searchsorted(self._bounds, v, side="left"), minlength=self._counts.size)
        with self._lock:
            self._counts += counts
            self._sum += float(v.sum())

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self):
        with self._lock:
            cum = np.cumsum(self._counts)
            total = self._sum
        buckets = [(repr(float(b)), int(c)) for b, c in zip(self._bounds, cum[:-1])] + [("+Inf", int(cum[-1]))]
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)


# ---- requests (vLLM's meanings) -------------------------------------------------------------
NUM_REQUESTS_RUNNING = Gauge("kvpager_num_requests_running",
                             "Requests with a sequence holding KV on an executor.", registry=REGISTRY)
NUM_REQUESTS_WAITING = Gauge("kvpager_num_requests_waiting",
                             "Requests admitted and waiting for KV (new, or preempted by recompute).",
                             registry=REGISTRY)
NUM_REQUESTS_SWAPPED = Gauge("kvpager_num_requests_swapped",
                             "Requests whose sequences are swapped out to an executor's CPU pool.",
                             registry=REGISTRY)
PROMPT_TOKENS = Counter("kvpager_prompt_tokens_total",
                        "Prompt tokens of requests whose prefill finished (prefix hits included).",
                        registry=REGISTRY)
GENERATION_TOKENS = Counter("kvpager_generation_tokens_total", "Tokens sampled.", registry=REGISTRY)
TTFT = Histogram("kvpager_time_to_first_token_seconds", "Arrival to first sampled token.",
                 buckets=_TTFT_BUCKETS, registry=REGISTRY)
ITL = BatchHistogram("kvpager_inter_token_latency_seconds",
                     "Between one step that sampled a request's tokens and the next.", _ITL_BUCKETS, REGISTRY)
TPOT = Histogram("kvpager_request_time_per_output_token_seconds",
                 "Per request: (last token - first token) / (generated tokens - 1).", buckets=_ITL_BUCKETS,
                 registry=REGISTRY)
E2E = Histogram("kvpager_e2e_request_latency_seconds", "Arrival to the request's end.",
                buckets=_REQUEST_BUCKETS, registry=REGISTRY)
QUEUE_TIME = Histogram("kvpager_request_queue_time_seconds", "Arrival to first scheduled.",
                       buckets=_REQUEST_BUCKETS, registry=REGISTRY)
PREFILL_TIME = Histogram("kvpager_request_prefill_time_seconds", "First scheduled to first token.",
                         buckets=_REQUEST_BUCKETS, registry=REGISTRY)
DECODE_TIME = Histogram("kvpager_request_decode_time_seconds", "First token to last token.",
                        buckets=_REQUEST_BUCKETS, registry=REGISTRY)
REQUEST_PROMPT_TOKENS = Histogram("kvpager_request_prompt_tokens", "Prompt tokens per finished request.",
                                  buckets=_TOKEN_BUCKETS, registry=REGISTRY)
REQUEST_GENERATION_TOKENS = Histogram("kvpager_request_generation_tokens",
                                      "Generated tokens per finished request (all completions).",
                                      buckets=_TOKEN_BUCKETS, registry=REGISTRY)
REQUEST_SUCCESS = Counter("kvpager_request_success_total",
                          "Requests that ended without an error, by finish reason (stop | length | abort).",
                          ["finished_reason"], registry=REGISTRY)

# ---- the engine loop ------------------------------------------------------------------------
FENCED = Gauge("kvpager_gateway_fenced",
               "1 once another gateway took the memory service over (this one stopped serving), else 0.",
               registry=REGISTRY)
REQUESTS_IN_FLIGHT = Gauge("kvpager_gateway_requests_in_flight", "Requests admitted and not finished.",
                           registry=REGISTRY)
REQUESTS_FINISHED = Counter("kvpager_gateway_requests_finished_total",
                            "Finished requests by outcome (ok | abort | the error's status, lower case).",
                            ["outcome"], registry=REGISTRY)
ABORTS = Counter("kvpager_gateway_aborts_total", "Requests cancelled, aborted or past their deadline.",
                 registry=REGISTRY)
SEQUENCES_READMITTED = Counter("kvpager_gateway_sequences_readmitted_total",
                               "Sequences admitted again (recompute) after a memory service or executor lost them.",
                               registry=REGISTRY)
ROWS_FED_AHEAD = Counter("kvpager_gateway_rows_fed_ahead_total",
                         "Decode rows sent fed with the token the executor's step before was still sampling.",
                         registry=REGISTRY)
STEPS_HELD_FOR_ARRIVALS = Counter("kvpager_gateway_steps_held_for_arrivals_total",
                                  "Times an executor's step, to be planned ahead behind its running prefill and "
                                  "not full, waited for arriving requests to settle (--arrival-settle-ms).",
                                  registry=REGISTRY)
STEPS_BEHIND_BURST = Counter("kvpager_gateway_steps_planned_behind_burst_total",
                             "Steps sent while a decode burst ran on their executor, fed its last samples "
                             "(planned near its end: --burst-plan-lead-ms).", registry=REGISTRY)
TOKENS_SAMPLED_AHEAD = Counter("kvpager_gateway_tokens_sampled_ahead_total",
                               "Tokens planned to be sampled ahead within a step (decode bursts, "
                               "--num-scheduler-steps).", registry=REGISTRY)
TOKENS_SAMPLED_AHEAD_CUT = Counter("kvpager_gateway_tokens_sampled_ahead_cut_total",
                                   "Tokens planned ahead that a burst cut short never sampled (a request "
                                   "arrived; given back to the memory service).", registry=REGISTRY)
TOKENS_SAMPLED_AHEAD_DISCARDED = Counter("kvpager_gateway_tokens_sampled_ahead_discarded_total",
                                         "Tokens a decode burst computed past its sequence's end (a stop "
                                         "condition mid-burst, an abort): discarded, never streamed.",
                                         registry=REGISTRY)
TOKENS_STREAMED_MID_BURST = Counter("kvpager_gateway_tokens_streamed_mid_burst_total",
                                    "Tokens taken from a decode burst's sub-steps as they ended (ExecuteStream: "
                                    "a client waited for them before the burst's end).", registry=REGISTRY)
STEP_SECONDS = Histogram("kvpager_gateway_step_seconds", "Engine step time by phase (plan | execute | total).",
                         ["phase"], registry=REGISTRY,
                         buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
SCHEDULED_SEQS = Histogram("kvpager_gateway_scheduled_sequences", "Sequences per step.", registry=REGISTRY,
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
HTTP_REQUESTS = Counter("kvpager_gateway_http_requests_total", "HTTP API requests by route and status.",
                        ["route", "status"], registry=REGISTRY)
