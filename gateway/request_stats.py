"""Per-request timings and what they feed: the vLLM-style request metrics
(``gateway.metrics``), one structured log line per finished request, and the
running totals behind the periodic engine stats line.

Times are ``time.perf_counter()`` seconds on the request: ``arrival_s``
(the API received it), ``scheduled_s`` (its first row in a plan),
``first_token_s`` and ``last_token_s`` (the engine applied a step that
sampled for it). Mutated by the engine loop only; the stats line reads
plain ints from its own task on the same loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from kvpager.errors import KvpagerError
from kvpager.seq_status import SeqStatus
from kvpager.telemetry import get_logger
from gateway import metrics
from gateway.state import Finish, Request, Seq

log = get_logger("gateway.requests")

QUEUE_REFRESH_S = 0.1  # the running / waiting / swapped gauges are recounted at most this often
_RANK = {SeqStatus.WAITING: 0, SeqStatus.SWAPPED: 1, SeqStatus.RUNNING: 2}


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class RequestStats:
    def __init__(self) -> None:
        self.num_prompt_tokens = 0       # cumulative, for the stats line's throughput
        self.num_generation_tokens = 0
        self.num_running = self.num_waiting = self.num_swapped = 0
        self._queue_at = -1.0

    def scheduled(self, req: Request, now: float) -> None:
        """The request's first row in a plan."""
        req.scheduled_s = now
        metrics.QUEUE_TIME.observe(now - req.arrival_s)

    def tokens(self, sampled: dict[Request, int], now: float) -> None:
        """One step's results applied: ``sampled`` = tokens sampled per request."""
        total = 0
        itl = []
        for req, n in sampled.items():
            total += n
            if req.first_token_s:
                itl.append(now - req.last_token_s)
            else:
                req.first_token_s = now
                metrics.TTFT.observe(now - req.arrival_s)
                if req.scheduled_s:
                    metrics.PREFILL_TIME.observe(now - req.scheduled_s)
                metrics.PROMPT_TOKENS.inc(len(req.prompt_ids))
                self.num_prompt_tokens += len(req.prompt_ids)
            req.last_token_s = now
        metrics.ITL.observe_many(itl)
        metrics.GENERATION_TOKENS.inc(total)
        self.num_generation_tokens += total

    def queue(self, seqs: Iterable[Seq], now: float, force: bool = False) -> None:
        """Recount requests running / waiting / swapped (a request counts by
        its most advanced sequence)."""
        if not force and now - self._queue_at < QUEUE_REFRESH_S:
            return
        self._queue_at = now
        rank: dict[Request, int] = {}
        for seq in seqs:
            r = _RANK.get(seq.status, 0)
            if rank.get(seq.request, -1) < r:
                rank[seq.request] = r
        counts = [0, 0, 0]
        for r in rank.values():
            counts[r] += 1
        self.num_waiting, self.num_swapped, self.num_running = counts
        metrics.NUM_REQUESTS_WAITING.set(counts[0])
        metrics.NUM_REQUESTS_SWAPPED.set(counts[1])
        metrics.NUM_REQUESTS_RUNNING.set(counts[2])

    def finished(self, req: Request, outcome: str, error: KvpagerError | None) -> None:
        """The request ended (``outcome``: ok | abort | an error status, lower
        case): its metrics and its one log line (never its prompt text)."""
        now = time.perf_counter()
        prompt, generated, cached = req.usage()
        e2e = now - req.arrival_s
        first = req.completions[0].finish if req.completions else Finish.NONE
        reason = "abort" if outcome == "abort" else first.name.lower() if first is not Finish.NONE else None
        if error is None and reason is not None:
            metrics.REQUEST_SUCCESS.labels(reason).inc()
            metrics.E2E.observe(e2e)
            metrics.REQUEST_PROMPT_TOKENS.observe(prompt)
            metrics.REQUEST_GENERATION_TOKENS.observe(generated)
            if req.first_token_s:
                decode = req.last_token_s - req.first_token_s
                metrics.DECODE_TIME.observe(decode)
                if generated > 1:
                    metrics.TPOT.observe(decode / (generated - 1))
        fields = dict(request_id=req.request_id, executor_id=req.executor_id, status=outcome,
                      finish_reason=reason, prompt_tokens=prompt, cached_tokens=cached, generated_tokens=generated,
                      num_completions=len(req.completions),
                      queue_time_ms=_ms(req.scheduled_s - req.arrival_s) if req.scheduled_s else None,
                      ttft_ms=_ms(req.first_token_s - req.arrival_s) if req.first_token_s else None,
                      e2e_ms=_ms(e2e))
        if error is None:
            log.info("request finished", **fields)
        else:
            log.warning("request failed", **fields, error=error.message)


class StatsLine:
    """Every ``interval_s``: one ``engine stats`` line (prompt / generation
    throughput over the interval, requests running / waiting / swapped, KV
    usage, prefix hit rate over the interval, preemptions) — vLLM's periodic
    line. KV figures come from one GetAccounting (``accounting()``) per line."""

    def __init__(self, stats: RequestStats, accounting: Callable, interval_s: float) -> None:
        self.stats = stats
        self.accounting = accounting
        self.interval_s = interval_s
        # (time, prompt tokens, generation tokens, prefix queries, prefix hits) at the last line;
        # the prefix counts are the memory service's, unknown until the first answer (0: since it started)
        self._last = (time.perf_counter(), stats.num_prompt_tokens, stats.num_generation_tokens, 0, 0)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.emit()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a stats line must never take the gateway down
                log.warning("engine stats failed", error=repr(exc))

    async def emit(self) -> dict:
        s = self.stats
        kv: dict = {}
        try:
            total = (await self.accounting()).total
            kv = dict(kv_cache_usage_perc=round(100.0 * total.used_blocks / total.total_blocks, 2)
                      if total.total_blocks else 0.0,
                      kv_token_occupancy_perc=round(100.0 * total.token_occupancy, 2),
                      queries=total.prefix_query_tokens, hits=total.prefix_hit_tokens, preemptions=total.preemptions)
        except KvpagerError as exc:
            kv = dict(kv_error=exc.message)
        now = time.perf_counter()
        last = self._last
        dt = max(now - last[0], 1e-9)
        queries, hits = kv.pop("queries", last[3]), kv.pop("hits", last[4])
        line = dict(prompt_throughput_tps=round((s.num_prompt_tokens - last[1]) / dt, 1),
                    generation_throughput_tps=round((s.num_generation_tokens - last[2]) / dt, 1),
                    running=s.num_running, waiting=s.num_waiting, swapped=s.num_swapped,
                    prefix_hit_rate_perc=round(100.0 * (hits - last[4]) / (queries - last[3]), 2)
                    if queries > last[3] else 0.0, **kv)
        self._last = (now, s.num_prompt_tokens, s.num_generation_tokens, queries, hits)
        log.info("engine stats", **line)
        return line
