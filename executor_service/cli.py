"""The executor's entry point: ``python -m executor_service`` (also ``kvpager executor``)."""

from __future__ import annotations

import argparse
import os

from executor_service.config import BACKENDS, DTYPES, KV_LAYOUTS, MODEL_IMPLS, ExecutorConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local HF checkpoint directory")
    p.add_argument("--model-id", default=None, help="identity sent to the memory service (default: dir name)")
    p.add_argument("--executor-id", default="executor-0")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--advertise-address", default=None, help="host:port registered with the memory service")
    p.add_argument("--memory-address", default=None, help="MemoryService host:port to register with")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None, help="device pool size in blocks")
    size.add_argument("--kv-cache-gib", type=float, default=None, help="device pool size on CPU (default 0.5)")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.9, help="CUDA pool sizing")
    p.add_argument("--swap-blocks", type=int, default=None, help="CPU swap pool blocks")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--attention-backend", choices=BACKENDS, default="auto",
                   help="auto: triton on CUDA; on CPU the C++ kernel (built on first use), else torch")
    p.add_argument("--model-impl", choices=MODEL_IMPLS, default="auto",
                   help="auto: kvpager's own Llama-family forward where it fits, else transformers' model code")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-layout", choices=KV_LAYOUTS, default="auto",
                   help="per-layer: one block table for all layers; hybrid: a table per KV group (sliding groups "
                        "free the blocks their window passed); auto (default): hybrid for a model with "
                        "sliding-window layers, else per-layer")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (no decode CUDA graphs; faster start, slower small batches)")
    p.add_argument("--no-cpu-bind", action="store_true",
                   help="CPU: leave the step's OpenMP threads unbound (by default, while a step uses every core "
                        "this process may run on, its threads are bound one per core; never when OMP_PROC_BIND, "
                        "OMP_PLACES, GOMP_CPU_AFFINITY or KMP_AFFINITY is set)")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="CPU: keep the KV pool on 4 KiB pages (by default its memory is advised for transparent "
                        "huge pages; the kernel's THP setting decides whether it gets them)")
    p.add_argument("--cpu-cores", default=None, metavar="LIST",
                   help="run on these CPUs only (e.g. 0-3 or 0,2): several executors on one host each take a "
                        "slice of its cores (kvpager up does this); default: every CPU the process may use")
    p.add_argument("--cuda-graph-max-batch", type=int, default=256,
                   help="CUDA: decode batches up to this many sequences replay a captured graph (sizes 1, 2, 4, "
                        "8, 16, ... to this); larger ones run eagerly")
    p.add_argument("--grace-s", type=float, default=5.0)
    from kvpager.security import add_security_arguments
    from kvpager.telemetry import add_observability_arguments

    add_observability_arguments(p)

    add_security_arguments(p, server=True, client=True, admin_token=True)


def preflight(args: argparse.Namespace) -> tuple[int, ...] | None:
    """What would fail later with a library traceback, checked now; returns
    ``--cpu-cores`` parsed (None: every CPU).

    Raises:
        UsageError: a model directory that cannot load, a port in use, a CPU list
            it may not use; the message names the flag.
    """
    from executor_service.model_runner import SUPPORTED_MODEL_TYPES
    from kvpager.preflight import check_model_dir, check_port_free

    check_model_dir(args.model, supported=SUPPORTED_MODEL_TYPES)
    check_port_free(args.host, args.port, flag="--port")
    check_port_free(args.metrics_host, args.metrics_port, flag="--metrics-port")
    return cpu_cores(args)


def cpu_cores(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--cpu-cores``, parsed and checked against the CPUs this process may use.

    Raises:
        UsageError: a list that does not parse or names a CPU outside that set.
    """
    if args.cpu_cores is None:
        return None
    from executor_service.cpu import allowed_cores, parse_cores
    from kvpager.preflight import UsageError

    if not hasattr(os, "sched_setaffinity"):
        raise UsageError("--cpu-cores: this platform has no per-process CPU affinity (Linux only)")
    try:
        cores = parse_cores(args.cpu_cores)
    except ValueError as exc:
        raise UsageError(f"--cpu-cores {exc}") from None
    outside = sorted(set(cores) - set(allowed_cores()))
    if outside:
        raise UsageError(f"--cpu-cores {args.cpu_cores}: CPU {outside} not among those this process may use "
                         f"({list(allowed_cores())})")
    return cores


def config_from_args(args: argparse.Namespace) -> ExecutorConfig:
    from kvpager.security import security_from_args

    model = args.model

    extra = {"kv_cache_gib": args.kv_cache_gib} if args.kv_cache_gib is not None else {}
    security = security_from_args(args)
    return ExecutorConfig(
        model=model,
        model_id=args.model_id,
        executor_id=args.executor_id,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        advertise_address=args.advertise_address,
        memory_address=args.memory_address,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        gpu_memory_fraction=args.gpu_memory_fraction,
        swap_blocks=args.swap_blocks,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        model_impl=args.model_impl,
        kv_layout=args.kv_layout,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        cpu_bind=not args.no_cpu_bind,
        huge_pages=not args.no_huge_pages,
        cuda_graph_max_batch=args.cuda_graph_max_batch,
        grace_s=args.grace_s,
        tls=security.server_tls(),
        client_tls=security.client_tls(),
        admin_token=security.admin_token,
        **extra,
    )


HELP = "run an executor (KV pool + model) gRPC server"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m executor_service", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvpager.preflight import BindError, report
    from kvpager.telemetry import configure_logging

    configure_logging("executor", level=args.log_level, log_format=args.log_format)
    try:
        cores = preflight(args)
        config = config_from_args(args)
    except ValueError as exc:  # a wrong model path, a port in use, a TLS cert without its key ...
        return report("kvpager executor", exc)
    from executor_service.cpu_allocator import keep_freed_memory
    from kvpager.telemetry import get_logger

    # Now, on the main thread, before any thread has an arena of its own (the model loads on
    # another): one arena for every thread (see keep_freed_memory).
    allocator = keep_freed_memory()
    get_logger(__name__).info("memory allocator", malloc=allocator.malloc_library,
                              glibc_keeps_freed_blocks=allocator.glibc_kept)
    if cores is not None:  # before the model loads and any OpenMP or gRPC thread starts: they inherit it
        from executor_service.cpu import restrict_to_cores

        restrict_to_cores(cores)
        get_logger(__name__).info("executor runs on its own CPUs", cpus=list(cores))

    async def serve() -> int:
        from executor_service.service import start_executor_server
        from kvpager.telemetry import get_logger

        server = await start_executor_server(config, wait_ready=False)
        ready = asyncio.ensure_future(server.wait_ready())
        serving = asyncio.ensure_future(server.serve_until_signal())
        try:
            await asyncio.wait([ready, serving], return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and not ready.cancelled() and ready.exception() is not None:
                # A model that cannot load must not leave a server NOT_SERVING forever. One line
                # for the operator; the traceback only at DEBUG.
                exc = ready.exception()
                log = get_logger(__name__)
                log.error("executor failed to start", error=f"{type(exc).__name__}: {exc}"[:500])
                log.debug("executor start failure", exc_info=exc)
                serving.cancel()
                return 1
            await serving
            return 0
        finally:
            await server.stop()

    try:
        return asyncio.run(serve())
    except BindError as exc:  # taken between the check and the bind
        return report("kvpager executor", exc)
