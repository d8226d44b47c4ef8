"""Rate-limited logging and bounded log fields.

A warning that a client (or a misbehaving peer) can trigger again and again
must not let it write the log at the rate it sends: ``LogLimiter`` lets one
line per key through per interval and says how many it held back; ``clip``
bounds a string field a peer chose (an executor id, an address) before it
goes into a line.
"""

from __future__ import annotations

import time
from collections import OrderedDict

MAX_FIELD_CHARS = 160


def clip(value: str, limit: int = MAX_FIELD_CHARS) -> str:
    """``value`` as a log field: at most ``limit`` characters (longer ones say how long they were)."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}…({len(value)} chars)"


class LogLimiter:
    """At most one line per key every ``interval_s``.

    Args:
        interval_s: the shortest time between two lines of one key.
        max_keys: keys remembered (least recently logged dropped first), so a
            caller that varies the key cannot grow this without bound.
    """

    def __init__(self, interval_s: float = 30.0, max_keys: int = 1024) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._last: OrderedDict[object, tuple[float, int]] = OrderedDict()  # key -> (logged at, held back since)

    def allow(self, key: object, now: float | None = None) -> int | None:
        """None: hold this line back. Otherwise log it, with the returned
        number of lines of this key held back since the last one."""
        now = time.monotonic() if now is None else now
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            self._last[key] = (seen[0], seen[1] + 1)
            return None
        self._last[key] = (now, 0)
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return seen[1] if seen is not None else 0

    def log(self, method, key: object, event: str, **fields) -> bool:
        """``method(event, **fields)`` (a structlog method) if ``key`` may log now; True when it did."""
        held = self.allow(key)
        if held is None:
            return False
        if held:
            fields["suppressed"] = held
        method(event, **fields)
        return True
