"""Logs and metrics shared by every service.

Logs are structlog lines on stderr (JSON by default, ``--log-format
console`` for people): ``timestamp``, ``level``, ``service`` and whatever is
bound in contextvars (the RPC interceptor binds ``request_id`` and
``method``). Records from stdlib ``logging`` (grpc, transformers, uvicorn) go
through the same renderer, so a service writes nothing else.

Metrics: one ``CollectorRegistry`` per service (``registry(name)``), so a
service's endpoint shows its own families even when several services share a
process (tests, the in-process stack). Each service's metrics module
registers into its own; the RPC metrics exist once per registry
(``rpc_metrics``), told apart by the ``service`` label. Every registry also
carries the process's own families (``process_resident_memory_bytes``,
``process_cpu_seconds_total``, ``process_start_time_seconds``, open fds;
``python_gc_*``, ``python_info``), as vLLM's default registry does: an
operator sees a service's memory grow, and a drill tells a restarted
process by its start time.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, make_wsgi_app)

LOG_FORMATS = ("json", "console")
_REGISTRIES: dict[str, CollectorRegistry] = {}
_REGISTRIES_LOCK = threading.Lock()


def registry(service: str) -> CollectorRegistry:
    """The one metrics registry of ``service`` ("memory", "executor",
    "gateway", ...) in this process, made on first use."""
    with _REGISTRIES_LOCK:
        reg = _REGISTRIES.get(service)
        if reg is None:
            reg = _REGISTRIES[service] = CollectorRegistry(auto_describe=True)
            # the process's own families (empty where /proc is missing): several services in one
            # process each show it, which is what their endpoints describe
            ProcessCollector(registry=reg)
            GCCollector(registry=reg)
            PlatformCollector(registry=reg)
        return reg


@dataclass(frozen=True, slots=True)
class RpcMetrics:
    requests: Counter
    latency: Histogram
    in_flight: Gauge


_RPC: dict[int, RpcMetrics] = {}


def rpc_metrics(service: str) -> RpcMetrics:
    """The RPC metrics in ``service``'s registry (made once per registry)."""
    reg = registry(service)
    with _REGISTRIES_LOCK:
        found = _RPC.get(id(reg))
        if found is None:
            found = _RPC[id(reg)] = RpcMetrics(
                Counter("kvpager_rpc_requests_total", "Finished RPCs by status code.",
                        ["service", "method", "code"], registry=reg),
                Histogram("kvpager_rpc_latency_seconds", "RPC handler latency, from dispatch to status.",
                          ["service", "method"], registry=reg,
                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                   5.0, 10.0, 30.0)),
                Gauge("kvpager_rpc_in_flight", "RPCs being handled now.", ["service", "method"], registry=reg))
        return found


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


def configure_logging(service: str, level: str = "INFO", json: bool = True, log_format: str | None = None) -> None:
    """Sets up structlog and stdlib logging for this process; safe to call again
    (the last call wins; a ``service`` bound in contextvars wins over this one).
    ``log_format`` ("json" | "console"), when given, decides over ``json``."""
    if log_format is not None:
        if log_format not in LOG_FORMATS:
            raise ValueError(f"unknown log format {log_format!r}: one of {', '.join(LOG_FORMATS)}")
        json = log_format == "json"
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
    """Prometheus text exposition on a daemon thread: ``/metrics`` (the
    service's registry), ``/health`` (200 while ``serving()``, else 503, so an
    HTTP probe means something), 404 for any other path.

    Our own loop rather than ``prometheus_client.start_http_server``: that one
    polls for shutdown every 0.5 s, so every close would cost half a second.
    """

    def __init__(self, port: int, host: str = "127.0.0.1", registry: CollectorRegistry | None = None,
                 serving: Callable[[], bool] = lambda: True) -> None:
        server_class = _ThreadingWSGIServer
        if ":" in host:
            server_class = type("_ThreadingWSGIServer6", (_ThreadingWSGIServer,), {"address_family": socket.AF_INET6})
        self._httpd = make_server(host, port, metrics_app(registry or CollectorRegistry(), serving), server_class,
                                  handler_class=_QuietHandler)
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=f"metrics:{self.port}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def metrics_app(registry: CollectorRegistry, serving: Callable[[], bool]):
    """The metrics server's WSGI app (see ``MetricsServer``)."""
    exposition = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return exposition(environ, start_response)
        if path == "/health":
            ok = serving()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"not serving\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [f"no such path {path!r}: /metrics, /health\n".encode()]

    return app


def add_observability_arguments(p) -> None:
    """The flags every service takes for its logs and metrics (argparse)."""
    g = p.add_argument_group("logs and metrics (docs/metrics.md)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics and an HTTP /health here (0: any free port; default: none)")
    g.add_argument("--metrics-host", default="127.0.0.1",
                   help="the metrics server's listen address (0.0.0.0: every interface, e.g. in a container)")
    g.add_argument("--log-level", default="INFO")
    g.add_argument("--log-format", choices=LOG_FORMATS, default="json",
                   help="json: one JSON object a line (default); console: readable lines for a terminal")
