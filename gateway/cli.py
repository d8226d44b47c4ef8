"""The gateway's entry point: `python -m gateway` (also `kvpager gateway`)."""

from __future__ import annotations

import argparse
import asyncio

HELP = "run the gateway (client API + continuous batching)"
API_KEY_ENV = "KVPAGER_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (its tokenizer is used)")
    p.add_argument("--memory-address", default="127.0.0.1:50051")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50050)
    http = p.add_argument_group("OpenAI-compatible HTTP API (docs/api.md)")
    http.add_argument("--http-port", type=int, default=8000, help="its port (0: any free one)")
    http.add_argument("--http-host", default=None, help="its host (default: --host)")
    http.add_argument("--no-http", action="store_true", help="serve gRPC only")
    http.add_argument("--served-model-name", default=None,
                      help="the model's name in the API (default: the checkpoint directory's name)")
    http.add_argument("--chat-template", default=None, metavar="FILE",
                      help="a Jinja chat template overriding the tokenizer's")
    http.add_argument("--api-key", default=None,
                      help=f"require this bearer token on /v1 (default: ${API_KEY_ENV}; the --auth-token is "
                           "accepted too)")
    add_scheduling_arguments(p)
    p.add_argument("--max-n", type=int, default=8, help="largest n / beam_width accepted")
    p.add_argument("--load-weight-tokens", type=float, default=16.0,
                   help="routing: one queued sequence costs this many prefix tokens")
    tenants = p.add_argument_group("tenants (docs/security.md, Tenants)")
    tenants.add_argument("--tenants", default=None, metavar="FILE",
                         help='a JSON object {"tenant": "token", ...}: each token is a bearer credential and its '
                              "holder's requests are that tenant's (cache_salt may only narrow its namespace)")
    tenants.add_argument("--prefix-sharing", choices=("isolated", "shared"), default="isolated",
                         help="prefix cache between tenants: isolated (default; no tenant ever hits another's "
                              "blocks) or shared")
    p.add_argument("--redis-url", default=None, help="score prefixes from the Redis mirror")
    p.add_argument("--routing", choices=("prefix", "round-robin"), default="prefix",
                   help="how requests pick an executor: longest cached prefix vs load (default), or in turn")
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="longest prompt accepted, in tokens (default 0: the context limit - 1)")
    p.add_argument("--step-timeout-s", type=float, default=120.0,
                   help="deadline of each internal Step and Execute call (a hung executor fails its requests "
                        "with UNAVAILABLE after this long)")
    p.add_argument("--max-retries", type=int, default=3,
                   help="times one sequence is admitted again (recompute) after a memory-service restart or the "
                        "loss of its executor; once more ends it UNAVAILABLE (0: never)")
    p.add_argument("--recovery-timeout-s", type=float, default=30.0,
                   help="longest a stream waits for a restarted memory service or an executor of its model to "
                        "take it back before it ends UNAVAILABLE")
    p.add_argument("--max-message-bytes", type=int, default=16 * 2**20,
                   help="largest request or response message (larger: RESOURCE_EXHAUSTED)")
    caps = p.add_argument_group("what one request may ask (docs/security.md, Limits)")
    caps.add_argument("--max-prompt-bytes", type=int, default=0,
                      help="UTF-8 bytes of a text prompt, checked before tokenizing (default 0: 16 per token of "
                           "the prompt limit, at least 64 KiB)")
    caps.add_argument("--max-stop-strings", type=int, default=64, help="stop strings per request")
    caps.add_argument("--max-stop-bytes", type=int, default=4096, help="UTF-8 bytes of a request's stop strings")
    caps.add_argument("--max-stop-token-ids", type=int, default=1024, help="stop token ids per request")
    caps.add_argument("--max-cache-salt-bytes", type=int, default=256, help="UTF-8 bytes of a cache_salt")
    caps.add_argument("--max-request-id-chars", type=int, default=128,
                      help="characters of a client's request_id (printable only)")
    p.add_argument("--executor-info-timeout-s", type=float, default=2.0,
                   help="deadline of an executor's GetInfo when it joins (then retried with backoff)")
    p.add_argument("--grace-s", type=float, default=5.0)
    p.add_argument("--stats-interval-s", type=float, default=10.0,
                   help="log an 'engine stats' line this often (throughput, queue, KV usage, prefix hits); 0: never")
    from kvpager.security import add_security_arguments
    from kvpager.telemetry import add_observability_arguments

    add_observability_arguments(p)

    add_security_arguments(p, server=True, client=True, auth_token=True, admin_token=True)


def preflight(args: argparse.Namespace) -> None:
    """A model directory that is not one, ports someone else holds: reported now, naming the flag.

    Raises:
        UsageError: the first check that fails.
    """
    from kvpager.preflight import check_model_dir, check_port_free

    check_model_dir(args.model, tokenizer=True)  # the gateway reads its tokenizer and generation config
    check_port_free(args.host, args.port, flag="--port")
    check_port_free(args.metrics_host, args.metrics_port, flag="--metrics-port")
    if not args.no_http:
        check_port_free(args.http_host or args.host, args.http_port, flag="--http-port")


# The scheduling flags' destinations: `kvpager up` offers the same group and passes each one on.
SCHEDULING_DESTS = ("policy", "max_batch_tokens", "max_running", "max_waiting", "stream_interval", "plan_ahead",
                    "num_scheduler_steps", "max_burst_ms", "cut_bursts", "burst_plan_lead_ms", "arrival_settle_ms")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    value = float(text)
    if not 0.0 <= value < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def scheduler_steps(text: str) -> int:
    """argparse type: --num-scheduler-steps, 1 to gateway.bursts.MAX_STEPS."""
    from gateway.bursts import MAX_STEPS

    value = positive_int(text)
    if value > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_STEPS}, got {value}")
    return value


def add_scheduling_arguments(p: argparse.ArgumentParser) -> None:
    """The continuous-batching loop's options (one definition: the gateway's
    parser and `kvpager up` both call this)."""
    from gateway.scheduling import DEFAULT_POLICY, POLICIES

    g = p.add_argument_group("scheduling (docs/api.md, Priorities)")
    g.add_argument("--policy", choices=sorted(POLICIES), default=DEFAULT_POLICY,
                   help="step order: priority (default: a request's priority, lower first, then FCFS among "
                        "equals) or fcfs (arrival only; priorities ignored)")
    g.add_argument("--stream-interval", type=positive_int, default=1,
                   help="tokens per streamed response for requests that set no stream_interval (default 1: "
                        "every step; larger values send fewer, larger deltas, which costs the gateway and "
                        "clients less per token)")
    g.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="tokens each executor computes per step (default 2048: the fastest on our CPU "
                        "benchmarks; smaller bounds how long a prefill step holds up the decodes beside it)")
    g.add_argument("--max-running", type=int, default=64, help="sequences each executor runs per step")
    g.add_argument("--max-waiting", type=int, default=1024, help="requests in flight before RESOURCE_EXHAUSTED")
    g.add_argument("--num-scheduler-steps", type=scheduler_steps, default=8,
                   help="decode bursts: an executor running only decodes computes up to this many tokens per "
                        "sequence in one step, each forward fed its own last sample (as vLLM's multi-step "
                        "scheduling; at most 64; a burst never delays a streamed delta). Fewer Step and "
                        "Execute round trips per token; a stop mid-burst wastes the rest of it "
                        "(default 8; 1: off)")
    g.add_argument("--max-burst-ms", type=non_negative_float, default=30.0,
                   help="the longest decode burst, in the executor's measured forward times (default 30; a "
                        "model whose one-token forward takes longer does not burst)")
    g.add_argument("--no-cut-bursts", dest="cut_bursts", action="store_false",
                   help="let a decode burst run to its end when a request arrives (default: the burst ends "
                        "before the next layer of the forward it is in, the request's prefill runs next, and "
                        "the tokens it did not sample are given back)")
    g.add_argument("--no-plan-ahead", dest="plan_ahead", action="store_false",
                   help="plan each step only after the previous one returned (default: the next step of an "
                        "executor is planned and sent while its current one runs)")
    g.add_argument("--burst-plan-lead-ms", type=non_negative_float, default=6.0,
                   help="with plan-ahead, a decode burst's next step is planned and sent this long (at least "
                        "one forward) before the burst should end by the executor's measured forwards, so the "
                        "executor does not wait for the result and the next plan between bursts; a request "
                        "arriving in that window waits for the burst's end (default 6; 0: a burst's next "
                        "step is planned after it returns)")
    g.add_argument("--arrival-settle-ms", type=non_negative_float, default=3.0,
                   help="with plan-ahead, the step planned while a prefill runs waits, when it is not full, "
                        "until no request has arrived for this long (or the prefill returns), so prompts sent "
                        "together go out in full steps; a request arriving at an idle executor is planned at "
                        "once (default 3; 0: planned at once)")


def scheduling_argv(args: argparse.Namespace) -> list[str]:
    """The gateway flags that reproduce ``args``' scheduling options."""
    argv = ["--policy", args.policy, "--max-batch-tokens", str(args.max_batch_tokens),
            "--max-running", str(args.max_running), "--max-waiting", str(args.max_waiting),
            "--stream-interval", str(args.stream_interval),
            "--num-scheduler-steps", str(args.num_scheduler_steps), "--max-burst-ms", f"{args.max_burst_ms:g}",
            "--burst-plan-lead-ms", f"{args.burst_plan_lead_ms:g}", "--arrival-settle-ms", f"{args.arrival_settle_ms:g}"]
    if not args.plan_ahead:
        argv.append("--no-plan-ahead")
    if not args.cut_bursts:
        argv.append("--no-cut-bursts")
    return argv


def config_from_args(args: argparse.Namespace):
    import os
    from pathlib import Path

    from gateway.engine_config import EngineConfig
    from gateway.http.server import HttpConfig
    from gateway.params import RequestCaps
    from gateway.recovery import RecoveryConfig
    from gateway.service import GatewayConfig
    from kvpager.security import security_from_args

    security = security_from_args(args)
    tenant_tokens = {}
    if args.tenants:
        from gateway.tenants import load_tenant_tokens

        tenant_tokens = load_tenant_tokens(args.tenants)
    if args.stats_interval_s < 0:
        raise ValueError(f"--stats-interval-s must be >= 0, got {args.stats_interval_s:g}")
    if args.max_retries < 0:
        raise ValueError(f"--max-retries must be >= 0, got {args.max_retries}")
    if args.recovery_timeout_s <= 0:
        raise ValueError(f"--recovery-timeout-s must be > 0, got {args.recovery_timeout_s:g}")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise ValueError(f"--chat-template {args.chat_template}: no such file")
    caps = RequestCaps(max_prompt_bytes=args.max_prompt_bytes, max_stop_strings=args.max_stop_strings,
                       max_stop_bytes=args.max_stop_bytes, max_stop_token_ids=args.max_stop_token_ids,
                       max_cache_salt_bytes=args.max_cache_salt_bytes,
                       max_request_id_chars=args.max_request_id_chars)
    for name in ("max_prompt_bytes", "max_stop_strings", "max_stop_bytes", "max_stop_token_ids",
                 "max_cache_salt_bytes", "max_request_id_chars"):
        if getattr(caps, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    http = None if args.no_http else HttpConfig(
        host=args.http_host or args.host, port=args.http_port, served_model_name=args.served_model_name or "",
        chat_template=args.chat_template, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)
    return GatewayConfig(model=args.model, memory_address=args.memory_address, host=args.host, port=args.port,
                         metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                         stats_interval_s=args.stats_interval_s, grace_s=args.grace_s, redis_url=args.redis_url,
                         routing=args.routing,
                         max_message_bytes=args.max_message_bytes, tls=security.server_tls(),
                         client_tls=security.client_tls(), auth_token=security.auth_token,
                         admin_token=security.admin_token, tenant_tokens=tenant_tokens,
                         prefix_sharing=args.prefix_sharing,
                         engine=EngineConfig(max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                                             max_waiting=args.max_waiting, max_n=args.max_n, policy=args.policy,
                                             load_weight_tokens=args.load_weight_tokens,
                                             max_prompt_tokens=args.max_prompt_tokens,
                                             stream_interval=args.stream_interval,
                                             step_timeout_s=args.step_timeout_s, plan_ahead=args.plan_ahead,
                                             num_scheduler_steps=args.num_scheduler_steps,
                                             max_burst_ms=args.max_burst_ms, cut_bursts=args.cut_bursts,
                                             burst_plan_lead_ms=args.burst_plan_lead_ms,
                                             arrival_settle_ms=args.arrival_settle_ms,
                                             executor_info_timeout_s=args.executor_info_timeout_s,
                                             caps=caps, recovery=RecoveryConfig(args.max_retries,
                                                                                args.recovery_timeout_s)),
                         http=http)


def run(args: argparse.Namespace) -> int:
    from gateway.service import GatewayServer
    from kvpager.preflight import BindError, report
    from kvpager.telemetry import configure_logging

    configure_logging("gateway", args.log_level, log_format=args.log_format)
    try:
        preflight(args)
        config = config_from_args(args)
    except ValueError as exc:  # a wrong model path, a port in use, a TLS cert without its key ...
        return report("kvpager gateway", exc)

    async def main() -> None:
        server = GatewayServer(config)
        await server.start()
        await server.serve_until_signal()

    try:
        asyncio.run(main())
    except BindError as exc:  # taken between the check and the bind
        return report("kvpager gateway", exc)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))
