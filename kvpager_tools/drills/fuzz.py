"""fuzz: randomly generated Generate requests and memory-service calls for a time budget.

Two phases share the budget:

* **Generate**: requests drawn from edge-heavy strategies (prompt text or
  token ids in and around the vocabulary, lengths around the context limit,
  max_tokens 0 / at / past the limit, NaN and infinite floats, n and
  beam_width around the cap, stop strings, seeds, priorities, salts,
  penalties, min_p, logit bias, top logprobs). Only
  OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED are
  acceptable; a completed request must have n completions of at most
  max_tokens in-vocabulary tokens.
* **memory service**: each example registers its own address-less executor
  (``fuzz-*``: never routed to, never leased) and sends a random sequence of
  Step / Fork / Free / ScorePrefix / Heartbeat / GetAccounting calls with
  sequence ids in a range the gateway never uses and ``step_id`` 0 (step ids
  are one increasing sequence per memory service: a random large one would
  fence the gateway's). Only OK, INVALID_ARGUMENT, NOT_FOUND,
  FAILED_PRECONDITION, ALREADY_EXISTS and RESOURCE_EXHAUSTED are acceptable;
  the accounting identities must hold after every call, and once every
  sequence is freed the executor's pool must be back at its baseline.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import random
import time

import grpc

from kvpager.channel import auth_metadata, make_channel
from kvpager_tools.drills import draws as st
from kvpager_tools.drills.common import DrillEnv, DrillResult, accounting_violations
from kvpager_tools.drills.runner import Needs
from kvpager.packed import pack_i32, pack_i64
from kvpager.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, memory_pb2, memory_pb2_grpc

NEEDS = Needs(executors=1)
GENERATE_ALLOWED = frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})
MEMORY_ALLOWED = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ALREADY_EXISTS",
                            "RESOURCE_EXHAUSTED"})
SEQ_BASE = 1 << 50  # fuzzed sequence ids: far from the gateway's


@dataclasses.dataclass
class Options:
    budget_s: float = dataclasses.field(default=60.0, metadata={"help": "time for both phases together"})
    generate_share: float = dataclasses.field(default=0.5, metadata={"help": "share of the budget for Generate"})
    generate_timeout_s: float = dataclasses.field(default=5.0, metadata={"help": "deadline of each Generate"})


class _Stubs:
    """Blocking stubs: the cases run on a worker thread."""

    def __init__(self, env: DrillEnv) -> None:
        sec = env.security
        tls = env.stack.client_tls
        a = env.stack.addresses
        self._channels = [make_channel(a.gateway, tls=tls, aio=False), make_channel(a.memory, tls=tls, aio=False)]
        self.gateway = gateway_pb2_grpc.GatewayStub(self._channels[0])
        self.memory = memory_pb2_grpc.MemoryServiceStub(self._channels[1])
        self.auth = auth_metadata(sec.auth_token) if sec and sec.auth_token else None
        self.admin = auth_metadata(sec.admin_token) if sec and sec.admin_token else None

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def memory_call(self, name: str, request, timeout_s: float = 10.0):
        """(status name, reply or None)."""
        try:
            return "OK", getattr(self.memory, name)(request, timeout=timeout_s, metadata=self.admin)
        except grpc.RpcError as err:
            return err.code().name, None


# --- Generate ---------------------------------------------------------------------------------------------


def _generate_strategy(info: gateway_pb2.ModelInfo) -> st.Strategy:
    limit, vocab, max_n = info.max_model_len, info.vocab_size, info.max_n or 8
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                       st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-8, 2.0, -1.0]))
    token = st.one_of(st.integers(3, vocab - 1), st.sampled_from([-1, 0, 1, 2, vocab, vocab + 1, 2**31 - 1, -2**31]))
    ids = st.one_of(st.lists(token, max_size=24),
                    st.builds(lambda n, t: [t] * n, st.sampled_from([limit - 2, limit - 1, limit, limit + 1]),
                              st.integers(3, vocab - 1)))
    text = st.text(max_size=64)
    seeds = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1]))

    @st.composite
    def request(draw):
        use_text = draw(st.booleans())
        prompt_ids = [] if use_text else draw(ids)
        prompt = draw(text) if use_text else draw(st.sampled_from(["", "", "x"]))
        known = len(prompt_ids) or 1
        max_tokens = draw(st.one_of(st.integers(0, 6), st.sampled_from(
            [limit - known, limit - known + 1, 2**32 - 1])))
        sp = common_pb2.SamplingParams(
            max_tokens=max(0, min(max_tokens, 2**32 - 1)), temperature=draw(floats), top_p=draw(floats),
            top_k=draw(st.sampled_from([-3, -1, 0, 1, 5, vocab, 2**31 - 1])),
            n=draw(st.sampled_from([0, 1, 2, max_n, max_n + 1])),
            stop=draw(st.lists(st.sampled_from(["", ".", "the", "\x00", "é"]), max_size=2)),
            stop_token_ids=draw(st.lists(token, max_size=2)), ignore_eos=draw(st.booleans()),
            beam_width=draw(st.sampled_from([0, 0, 1, 2, max_n, max_n + 1])), length_penalty=draw(floats),
            min_tokens=draw(st.sampled_from([0, 0, 1, 3, 10])), logprobs=draw(st.sampled_from([0, 1, 5])),
            presence_penalty=draw(floats), frequency_penalty=draw(floats), repetition_penalty=draw(floats),
            min_p=draw(floats), top_logprobs=draw(st.sampled_from([0, 0, 1, 20, 21, 2**32 - 1])),
            logit_bias=draw(st.dictionaries(token, floats, max_size=3)))
        if draw(st.booleans()):
            sp.seed = draw(seeds)
        return gateway_pb2.GenerateRequest(
            prompt=prompt, prompt_token_ids=prompt_ids, sampling_params=sp,
            priority=draw(st.sampled_from([0, 1, -1, 2**31 - 1, -2**31])), cache_salt=draw(st.sampled_from(
                ["", "tenant", "é\x00"])), skip_special_tokens=draw(st.booleans()))

    @st.composite
    def plausible(draw):
        """Mostly valid requests, so the fuzz also runs the engine (n > 1, beams, stops, seeds)."""
        beam = draw(st.sampled_from([0, 0, 0, 2, 3]))
        n = draw(st.sampled_from([1, 1, 2, 3])) if not beam else draw(st.integers(1, beam))
        sp = common_pb2.SamplingParams(
            max_tokens=draw(st.integers(1, 8)), temperature=0.0 if beam else draw(st.sampled_from([0.0, 0.7, 1.3])),
            top_p=draw(st.sampled_from([0.0, 0.5, 1.0])), top_k=draw(st.sampled_from([-1, 0, 1, 20])), n=n,
            beam_width=beam, ignore_eos=draw(st.booleans()), min_tokens=draw(st.sampled_from([0, 2])),
            length_penalty=draw(st.sampled_from([0.0, 0.5, 2.0, -1.0])),
            stop=draw(st.lists(st.sampled_from([".", "the", "é"]), max_size=1)),
            stop_token_ids=draw(st.lists(st.integers(3, vocab - 1), max_size=2)),
            logprobs=draw(st.sampled_from([0, 1])), top_logprobs=draw(st.sampled_from([0, 0, 3])),
            repetition_penalty=draw(st.sampled_from([0.0, 0.0, 1.3])),
            presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.5])), min_p=draw(st.sampled_from([0.0, 0.0, 0.1])),
            logit_bias=draw(st.dictionaries(st.integers(3, vocab - 1), st.sampled_from([-100.0, 5.0]), max_size=2)))
        if draw(st.booleans()):
            sp.seed = draw(seeds)
        use_text = draw(st.booleans())
        return gateway_pb2.GenerateRequest(
            prompt=draw(st.text(min_size=1, max_size=40)) if use_text else "",
            prompt_token_ids=[] if use_text else draw(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=40)),
            sampling_params=sp, priority=draw(st.integers(-2, 2)), cache_salt=draw(st.sampled_from(["", "t"])))

    return st.one_of(request(), plausible())


def _check_completion(result: DrillResult, request: gateway_pb2.GenerateRequest, responses, vocab: int) -> None:
    sp = request.sampling_params
    want = (sp.beam_width if sp.beam_width > 1 else (sp.n or 1))
    tokens = collections.defaultdict(list)
    finished = set()
    for r in responses:
        tokens[r.index].extend(r.token_ids)
        if r.finish_reason:
            finished.add(r.index)
    if sp.beam_width > 1:
        ok = 1 <= len(finished) <= want  # beam search returns up to n of the beams
    else:
        ok = len(finished) == want
    if not ok:
        result.violation(f"completed request has {len(finished)} finished completions, want {want}")
    max_tokens = sp.max_tokens or float("inf")  # 0: the rest of the context (the executor bounds it)
    for index, toks in tokens.items():
        if len(toks) > max_tokens:
            result.violation(f"completion {index} has {len(toks)} tokens > max_tokens {sp.max_tokens}")
        if any(not 0 <= t < vocab for t in toks):
            result.violation(f"completion {index} has a token outside the vocabulary")


# --- memory service ----------------------------------------------------------------------------------------


def _memory_strategy(vocab: int):
    seq = st.integers(0, 7).map(lambda i: SEQ_BASE + i) | st.sampled_from([-1, 0])
    tokens = st.lists(st.integers(-1, vocab + 1), max_size=40)
    packed_or_junk = lambda values, pack: st.one_of(  # noqa: E731
        values.map(pack), st.binary(max_size=9))

    @st.composite
    def step(draw, executor_id):
        new = [memory_pb2.NewSequence(
            seq_id=draw(seq), executor_id=draw(st.sampled_from([executor_id, executor_id, "fuzz-nope", ""])),
            prompt_token_ids=draw(packed_or_junk(tokens, pack_i32)),
            priority=draw(st.integers(-3, 3)), cache_salt=draw(st.sampled_from(["", "s"])),
            max_total_tokens=draw(st.sampled_from([0, 0, 1, 16, 64, 600])))
            for _ in range(draw(st.integers(0, 3)))]
        sched_ids = draw(st.lists(seq, max_size=4))
        sched_n = draw(st.one_of(st.lists(st.integers(-1, 40), min_size=len(sched_ids), max_size=len(sched_ids)),
                                 st.lists(st.integers(-1, 40), max_size=5)))
        app_ids = draw(st.lists(seq, max_size=3, unique=True))
        app_tokens = draw(st.lists(st.integers(-1, vocab + 1), min_size=len(app_ids), max_size=len(app_ids)))
        appended = (common_pb2.TokenBatch(seq_ids=pack_i64(app_ids), offsets=pack_i32(range(len(app_ids) + 1)),
                                          token_ids=pack_i32(app_tokens)) if app_ids and draw(st.booleans())
                    else common_pb2.TokenBatch(seq_ids=draw(st.binary(max_size=17)),
                                               offsets=draw(st.binary(max_size=9)),
                                               token_ids=draw(st.binary(max_size=9))) if draw(st.booleans())
                    else None)
        forks = [common_pb2.ForkOp(parent_seq_id=draw(seq), child_seq_ids=draw(st.lists(seq, max_size=3)))
                 for _ in range(draw(st.integers(0, 1)))]
        return memory_pb2.StepRequest(
            step_id=0, appended=appended, forks=forks,
            free_seq_ids=draw(packed_or_junk(st.lists(seq, max_size=2), pack_i64)),
            abort_seq_ids=draw(packed_or_junk(st.lists(seq, max_size=2), pack_i64)),
            new_sequences=new, schedule_seq_ids=pack_i64(sched_ids), schedule_num_tokens=pack_i32(sched_n))

    def op(executor_id):
        return st.one_of(
            st.tuples(st.just("Step"), step(executor_id)),
            st.tuples(st.just("Step"), step(executor_id)),
            st.tuples(st.just("Fork"), st.builds(lambda p, c: memory_pb2.ForkRequest(
                fork=common_pb2.ForkOp(parent_seq_id=p, child_seq_ids=c)), seq, st.lists(seq, max_size=3))),
            st.tuples(st.just("Free"), st.builds(lambda ids, abort: memory_pb2.FreeRequest(seq_ids=ids, abort=abort),
                                                 st.lists(seq, max_size=3), st.booleans())),
            st.tuples(st.just("ScorePrefix"), st.builds(
                lambda t, salt, ids: memory_pb2.ScorePrefixRequest(token_ids=t, cache_salt=salt, executor_ids=ids),
                packed_or_junk(tokens, pack_i32), st.sampled_from(["", "s"]),
                st.lists(st.sampled_from([executor_id, "fuzz-nope"]), max_size=2))),
            st.tuples(st.just("Heartbeat"), st.builds(
                lambda e, inc: memory_pb2.HeartbeatRequest(executor_id=e, incarnation=inc),
                st.sampled_from([executor_id, "fuzz-nope"]), st.integers(0, 2**64 - 1))),
            st.tuples(st.just("GetAccounting"), st.builds(
                lambda e: memory_pb2.AccountingRequest(executor_id=e), st.sampled_from([executor_id, "fuzz-nope"]))))

    @st.composite
    def example(draw, executor_id):
        info = memory_pb2.ExecutorPoolInfo(
            # Huge pools must be refused cheaply, never allocated.
            executor_id=executor_id, num_blocks=draw(st.one_of(st.integers(0, 48), st.sampled_from(
                [(1 << 22) + 1, 2**32 - 1]))), block_size=draw(st.sampled_from([0, 1, 2, 4, 16, 33, 2**32 - 1])),
            num_swap_blocks=draw(st.one_of(st.integers(0, 8), st.just(2**32 - 1))), model_id="fuzz",
            incarnation=draw(st.integers(0, 2**64 - 1)), pool_generation=draw(st.integers(0, 3)),
            max_model_len=draw(st.sampled_from([0, 8, 64, 512])), vocab_size=draw(st.sampled_from([0, vocab])))
        return info, draw(st.lists(op(executor_id), min_size=1, max_size=10))

    return example


def _fuzz_memory_example(stubs: _Stubs, result: DrillResult, counts: collections.Counter, info, ops) -> None:
    def call(name, request):
        status, reply = stubs.memory_call(name, request)
        result.record(status)
        counts[f"{name}:{status}"] += 1
        if status not in MEMORY_ALLOWED and status != "OK":
            result.violation(f"{name} -> {status}: {request!r:.300}")
        return status, reply

    def check(after: str) -> None:
        status, snap = stubs.memory_call("GetAccounting", memory_pb2.AccountingRequest())
        if status != "OK":
            result.violation(f"GetAccounting after {after} -> {status}")
            return
        for v in accounting_violations(snap):
            result.violation(f"after {after}: {v}")

    status, _ = call("RegisterExecutor", memory_pb2.RegisterExecutorRequest(info=info))
    try:
        for name, request in ops:
            call(name, request)
            check(name)
        # Free everything this example may have created; the pool must be back at its baseline.
        ids = [SEQ_BASE + i for i in range(8)] + [-1, 0]
        for seq_id in ids:
            stubs.memory_call("Free", memory_pb2.FreeRequest(seq_ids=[seq_id], abort=True))
        if status == "OK":
            st_, snap = stubs.memory_call("GetAccounting", memory_pb2.AccountingRequest(executor_id=info.executor_id))
            if st_ == "OK":
                p = snap.total
                if (p.used_blocks or p.num_sequences or p.num_swapped_sequences
                        or p.swap_free_blocks != p.swap_total_blocks):
                    result.violation(f"{info.executor_id} not at baseline after freeing every sequence: "
                                     f"used {p.used_blocks}, sequences {p.num_sequences}, "
                                     f"swap {p.swap_free_blocks}/{p.swap_total_blocks}")
    finally:
        if status == "OK":
            stubs.memory_call("DeregisterExecutor", memory_pb2.DeregisterExecutorRequest(
                executor_id=info.executor_id, incarnation=info.incarnation))
        check("cleanup")


def _fuzz(env: DrillEnv, opts: Options, info: gateway_pb2.ModelInfo, seed: int) -> tuple[DrillResult, dict]:
    result = DrillResult("fuzz")
    figures = {"generate_examples": 0, "memory_examples": 0, "generate_outcomes": collections.Counter(),
               "memory_outcomes": collections.Counter()}
    stubs = _Stubs(env)
    rng = random.Random(seed)
    t0 = time.monotonic()
    generate_until = t0 + opts.budget_s * opts.generate_share
    memory_until = t0 + opts.budget_s
    requests = _generate_strategy(info)
    examples = _memory_strategy(info.vocab_size)
    try:
        while time.monotonic() < generate_until:
            request = requests.draw(rng)
            figures["generate_examples"] += 1
            try:
                responses = list(stubs.gateway.Generate(request, timeout=opts.generate_timeout_s,
                                                        metadata=stubs.auth))
                status = "OK"
            except grpc.RpcError as err:
                status, responses = err.code().name, None
            result.record(status)
            figures["generate_outcomes"][status] += 1
            if responses is not None:
                _check_completion(result, request, responses, info.vocab_size)
        n = 0
        while time.monotonic() < memory_until:
            n += 1
            executor_id = f"fuzz-{seed}-{n}"
            pool_info, ops = examples(executor_id).draw(rng)
            figures["memory_examples"] += 1
            _fuzz_memory_example(stubs, result, figures["memory_outcomes"], pool_info, ops)
    finally:
        stubs.close()
    figures["generate_outcomes"] = dict(sorted(figures["generate_outcomes"].items()))
    figures["memory_outcomes"] = dict(sorted(figures["memory_outcomes"].items()))
    return result, figures


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    info = await env.clients.model_info()
    result, figures = await asyncio.to_thread(_fuzz, env, opts, info, env.seed * 1000 + 1)
    gen = {s for s, _ in figures["generate_outcomes"].items()}
    bad = {s for s in gen if s != "OK" and s not in GENERATE_ALLOWED}
    for s in sorted(bad):
        result.violation(f"Generate -> {s} ({figures['generate_outcomes'][s]} times)")
    result.figures.update(figures)
    # No fuzz executor may be left behind.
    listed = await env.clients.memory.ListExecutors(memory_pb2.ListExecutorsRequest(), timeout=5)
    left = [e.executor_id for e in listed.executors if e.executor_id.startswith("fuzz-")]
    if left:
        result.violation(f"fuzz executors left registered: {left[:5]}")
    if math.isfinite(opts.budget_s):
        result.figures["budget_s"] = opts.budget_s
    return result
