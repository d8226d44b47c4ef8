"""Logs and metrics shared by every service.

Logs are structlog JSON lines on stderr: ``timestamp``, ``level``,
``service`` and whatever is bound in contextvars (the RPC interceptor binds
``request_id`` and ``method``). Records from stdlib ``logging`` (grpc,
transformers) go through the same renderer.

The RPC metrics are defined once here, at import; several services may run in
one process (tests, ``kvpager up``) and share them, told apart by the
``service`` label. Never construct them again elsewhere.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import sys
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

RPC_REQUESTS = Counter(
    "kvpager_rpc_requests_total",
    "Finished RPCs by status code.",
    ["service", "method", "code"],
)
RPC_LATENCY = Histogram(
    "kvpager_rpc_latency_seconds",
    "RPC handler latency, from dispatch to status.",
    ["service", "method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RPC_IN_FLIGHT = Gauge(
    "kvpager_rpc_in_flight",
    "RPCs being handled now.",
    ["service", "method"],
)


_WRITE_LOCK = threading.Lock()


class _StderrLogger:
    """Writes each rendered line to whatever ``sys.stderr`` is *now*, so a
    logger configured once survives pytest swapping the stream."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name

    def msg(self, message: str) -> None:
        with _WRITE_LOCK:
            print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


class _StderrHandler(logging.StreamHandler):
    """A stdlib handler on the current ``sys.stderr`` (same reason as above)."""

    kvpager_owned = True

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging(service: str, level: str = "INFO", json: bool = True) -> None:
    """Sets up structlog and stdlib logging for this process; safe to call again
    (the last call wins; a ``service`` bound in contextvars wins over this one)."""
    level_no = logging.getLevelName(level.upper())
    if not isinstance(level_no, int):
        raise ValueError(f"unknown log level {level!r}")

    def add_service(logger, _method, event_dict):
        if getattr(logger, "name", None):
            event_dict.setdefault("logger", logger.name)
        event_dict.setdefault("service", service)
        return event_dict

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_service,
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    # Tracebacks as data, without frame locals (they can hold tokens or tensors).
    tail = (
        [structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))]
        if json
        else []
    )
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), *tail, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=lambda name=None, *_args: _StderrLogger(name),
        cache_logger_on_first_use=False,
    )

    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail, renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "kvpager_owned", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_no)


def get_logger(name: str | None = None):
    """A structlog logger (``name`` bound as ``logger``). Lazy: safe at module
    import, before ``configure_logging`` runs."""
    # The name travels as a logger-factory argument (a ``logger=`` keyword
    # would collide with structlog's own); ``add_service`` writes it out.
    return structlog.get_logger(name) if name else structlog.get_logger()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *_args) -> None:  # scrapes are not log lines
        pass


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class MetricsServer:
    """Prometheus text exposition (``/metrics``) on a daemon thread.

    Our own loop rather than ``prometheus_client.start_http_server``: that one
    polls for shutdown every 0.5 s, so every close would cost half a second.
    """

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        server_class = _ThreadingWSGIServer
        if ":" in host:
            server_class = type("_ThreadingWSGIServer6", (_ThreadingWSGIServer,), {"address_family": socket.AF_INET6})
        self._httpd = make_server(host, port, make_wsgi_app(), server_class, handler_class=_QuietHandler)
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=f"metrics:{self.port}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int | None, host: str = "127.0.0.1") -> int | None:
    """Serves /metrics; ``port=0`` picks a free port. Returns the bound port, or
    None (and serves nothing) when ``port`` is None."""
    if port is None:
        return None
    return MetricsServer(port, host).port
