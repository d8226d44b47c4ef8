"""What a client learns when something inside the stack fails.

Errors from the memory service or an executor name internal addresses,
executor and sequence ids and the other service's own messages ("memory
service 127.0.0.1:43435: appended: sequence 2382 was already freed"). Those
go to the gateway's log, with the ids of the requests they ended; the client
gets a status code and a generic message it can act on (UNAVAILABLE: retry;
INTERNAL: a bug, the request was ended). The log lines are rate-limited per
kind, peer and status: a failing peer cannot make the gateway write at the
rate it fails, and a different failure (another executor, another cause:
a refused step after a crash) is not held back behind it.
"""

from __future__ import annotations

from kvpager.errors import Internal, KvpagerError, Unavailable
from kvpager.log_limits import LogLimiter, clip
from kvpager.telemetry import get_logger

log = get_logger("gateway.engine")

MEMORY_UNAVAILABLE = "the memory service is unavailable; retry"
STATE_RESET = "the serving state was reset; retry"
EXECUTOR_FAILED = "the executor serving this request failed; retry"
EXECUTOR_LEFT = "the executor serving this request left or restarted; retry"
INTERNAL = "internal error; the request was ended"
RETRIES_EXHAUSTED = "the request lost its serving state more often than the gateway retries (--max-retries); retry"
RECOVERY_TIMEOUT = "no memory service or executor took the request back in time (--recovery-timeout-s); retry"
FENCED = ("this gateway was fenced: another gateway drives the memory service now; "
          "send requests to that one (or restart this one)")
MAX_IDS_LOGGED = 32


def for_client(exc: BaseException, unavailable: str) -> KvpagerError:
    """The error a client gets for an internal failure ``exc``: UNAVAILABLE
    (with ``unavailable`` as its message) when retrying can help, else INTERNAL."""
    if isinstance(exc, Unavailable):
        return Unavailable(unavailable, retry_after_s=1.0)
    return Internal(INTERNAL)


class FailureLog:
    """The details clients do not get, at most one line per (kind, executor,
    status) every ``interval_s``."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self._limiter = LogLimiter(interval_s)

    def ended(self, kind: str, detail: BaseException | str, request_ids: list[str], **fields) -> None:
        message = detail.message if isinstance(detail, KvpagerError) else str(detail)
        ids = [clip(r, 40) for r in request_ids[:MAX_IDS_LOGGED]]
        key = (kind, fields.get("executor_id"), getattr(detail, "status", type(detail).__name__))
        self._limiter.log(log.warning, key, kind, error=clip(message, 400), requests_ended=len(request_ids),
                          request_ids=ids, **fields)
