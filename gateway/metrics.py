"""Gateway metrics (defined once per process)."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS_RUNNING = Gauge("kvpager_gateway_requests_in_flight", "Requests admitted and not finished.")
REQUESTS_FINISHED = Counter("kvpager_gateway_requests_finished_total", "Finished requests by outcome.", ["outcome"])
ABORTS = Counter("kvpager_gateway_aborts_total", "Requests cancelled, aborted or past their deadline.")
PREEMPTIONS = Counter("kvpager_gateway_preemptions_total", "Preemptions seen in plans.", ["mode"])
TOKENS_GENERATED = Counter("kvpager_gateway_generated_tokens_total", "Tokens sampled.")
ROWS_FED_AHEAD = Counter("kvpager_gateway_rows_fed_ahead_total",
                         "Decode rows sent fed with the token the executor's step before was still sampling.")
STEP_SECONDS = Histogram("kvpager_gateway_step_seconds", "Engine step time by phase.", ["phase"],
                         buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
SCHEDULED_SEQS = Histogram("kvpager_gateway_scheduled_sequences", "Sequences per step.",
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
TTFT_SECONDS = Histogram("kvpager_gateway_ttft_seconds", "Time to first token.",
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
HTTP_REQUESTS = Counter("kvpager_gateway_http_requests_total", "HTTP API requests by route and status.",
                        ["route", "status"])
