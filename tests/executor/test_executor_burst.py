"""Decode bursts (ExecuteRequest.decode_steps): one Execute runs several
one-token forwards per row, each fed what the one before sampled. Greedy
output equals transformers' generate; seeded sampling equals the same
decodes one step at a time; a burst fed by a step planned ahead works; a
malformed burst is refused and changes nothing."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from executor_harness import Plan, prompts
from kvpager import packed

CKPT = "llama_gqa"


def _burst_request(plan: Plan, items, steps: int, **kw):
    """items: [(seq, q)]: each row's last known token then q - 1 placeholders."""
    for seq, q in items:
        seq.tokens.extend([-1] * (q - 1))
    req = plan.request(items, num_samples=[1] * len(items), **kw)
    for seq, q in items:
        del seq.tokens[len(seq.tokens) - (q - 1):]
    req.decode_steps = steps
    return req


def _burst(plan: Plan, items, steps: int, **kw):
    req = _burst_request(plan, items, steps, **kw)
    resp = plan.served.stub.Execute(req, timeout=120)
    plan.sent_tables(req, items)
    sampled = list(packed.unpack_i32(resp.sampled_token_ids))
    assert len(sampled) == sum(q for _, q in items)
    pos = 0
    for seq, q in items:
        seq.num_computed += q
        seq.tokens.extend(sampled[pos:pos + q])
        pos += q
    return resp


def test_burst_matches_generate(serve, oracle):
    served = serve(CKPT)
    plan = Plan(served)
    seqs = [plan.new_seq(p) for p in prompts(3, [5, 19, 2], seed=31)]
    lens = [len(s.tokens) for s in seqs]
    plan.prefill(seqs)  # one token each
    _burst(plan, [(seqs[0], 4), (seqs[1], 2), (seqs[2], 4)], 4)
    plan.decode(seqs, 1)  # a plain decode after a burst: the counts agree
    _burst(plan, [(seqs[0], 3), (seqs[1], 5), (seqs[2], 1)], 5)
    for s, n in zip(seqs, lens):
        assert s.tokens[n:] == oracle(CKPT).greedy(s.tokens[:n], len(s.tokens) - n)
    assert [len(s.tokens) - n for s, n in zip(seqs, lens)] == [9, 9, 7]


def test_burst_samples_as_single_steps(serve):
    """Sampling is keyed by (seed, position): a burst draws what single steps draw."""
    served = serve(CKPT)
    plan = Plan(served)
    ps = prompts(2, [6, 11], seed=32)
    one = [plan.new_seq(p, seed=7 + i, temperature=1.0, top_p=0.9) for i, p in enumerate(ps)]
    many = [plan.new_seq(p, seed=7 + i, temperature=1.0, top_p=0.9) for i, p in enumerate(ps)]
    plan.prefill(one + many)
    plan.decode(one, 6)
    resp = _burst(plan, [(s, 6) for s in many], 6, return_logprobs=True)
    assert [s.tokens for s in many] == [s.tokens for s in one]
    assert len(packed.unpack_f32(resp.sampled_logprobs)) == 12


def test_burst_after_a_step_planned_ahead(serve, oracle):
    """The burst's first token is a placeholder: the sample of the step still running."""
    served = serve(CKPT)
    plan = Plan(served)
    seqs = [plan.new_seq(p) for p in prompts(2, [7, 3], seed=33)]
    lens = [len(s.tokens) for s in seqs]
    items = [(s, len(s.tokens)) for s in seqs]
    first = plan.request(items)
    future = served.stub.Execute.future(first, timeout=60)
    plan.sent_tables(first, items)
    for s, q in items:
        s.num_computed += q
        s.tokens.append(-1)  # what `first` samples: the burst's first token
    burst_items = [(s, 3) for s in seqs]
    req = _burst_request(plan, burst_items, 3)
    req.prev_step_id = first.step_id
    for s in seqs:
        s.tokens.pop()
    for s, tok in zip(seqs, packed.unpack_i32(future.result().sampled_token_ids)):
        s.tokens.append(tok)
    resp = served.stub.Execute(req, timeout=60)
    plan.sent_tables(req, burst_items)
    sampled = list(packed.unpack_i32(resp.sampled_token_ids))
    for i, s in enumerate(seqs):
        s.num_computed += 3
        s.tokens.extend(sampled[3 * i:3 * i + 3])
    for s, n in zip(seqs, lens):
        assert s.tokens[n:] == oracle(CKPT).greedy(s.tokens[:n], 4)


@pytest.mark.parametrize("bad", ["real_token", "too_long", "top_logprobs", "no_prev"])
def test_malformed_burst_refused(serve, oracle, bad):
    served = serve(CKPT)
    plan = Plan(served)
    [seq] = [plan.new_seq(p) for p in prompts(1, [5], seed=34)]
    plan.prefill([seq])
    kw = {"num_top_logprobs": [2]} if bad == "top_logprobs" else {}
    req = _burst_request(plan, [(seq, 3)], 2 if bad == "too_long" else 3, **kw)
    toks = list(packed.unpack_i32(req.token_ids))
    if bad == "real_token":
        toks[1] = 5
    if bad == "no_prev":
        toks[0] = -1
    req.token_ids = packed.pack_i32(toks)
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(served.stub.ExecuteStream(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    plan.decode([seq], 2)  # the executor is unharmed: its tables did not move
    assert seq.tokens[5:] == oracle(CKPT).greedy(seq.tokens[:5], 3)


def test_burst_streamed_sub_step_by_sub_step(serve):
    """ExecuteStream: each sub-step but the last comes as it ends (the rows still
    going, in row order, with logprobs), then the whole response, equal to what
    Execute answers for the same burst."""
    served = serve(CKPT)
    plan = Plan(served)
    ps = prompts(3, [6, 11, 4], seed=35)
    kw = dict(temperature=1.0, top_p=0.9)
    unary = [plan.new_seq(p, seed=40 + i, **kw) for i, p in enumerate(ps)]
    streamed = [plan.new_seq(p, seed=40 + i, **kw) for i, p in enumerate(ps)]
    plan.prefill(unary + streamed)
    whole = _burst(plan, [(s, q) for s, q in zip(unary, (4, 2, 3))], 4, return_logprobs=True)
    items = [(s, q) for s, q in zip(streamed, (4, 2, 3))]
    req = _burst_request(plan, items, 4, return_logprobs=True)
    msgs = list(served.stub.ExecuteStream(req, timeout=120))
    plan.sent_tables(req, items)
    *parts, last = msgs
    assert [(m.partial, m.sub_step) for m in parts] == [(True, 0), (True, 1), (True, 2)]
    assert not last.partial and last.sampled_token_ids == whole.sampled_token_ids
    # other sequences' rows (same prompts and seeds) from a shared prefill: the same logprobs up to rounding
    assert np.allclose(packed.unpack_f32(last.sampled_logprobs), packed.unpack_f32(whole.sampled_logprobs),
                       rtol=1e-4, atol=1e-5)
    tokens, logprobs = packed.unpack_i32(last.sampled_token_ids), packed.unpack_f32(last.sampled_logprobs)
    starts = [0, 4, 6]
    for j, m in enumerate(parts):
        going = [i for i, (_, q) in enumerate(items) if q > j]
        assert list(packed.unpack_i32(m.sampled_token_ids)) == [tokens[starts[i] + j] for i in going]
        assert list(packed.unpack_f32(m.sampled_logprobs)) == [logprobs[starts[i] + j] for i in going]


def test_stream_of_a_plain_step_is_one_message(serve, oracle):
    served = serve(CKPT)
    plan = Plan(served)
    [seq] = [plan.new_seq(p) for p in prompts(1, [5], seed=36)]
    items = [(seq, len(seq.tokens))]
    req = plan.request(items)
    [msg] = list(served.stub.ExecuteStream(req, timeout=60))
    assert not msg.partial
    assert list(packed.unpack_i32(msg.sampled_token_ids)) == oracle(CKPT).greedy(seq.tokens, 1)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("heard", ["mid_forward", "between_sub_steps"])
def test_a_burst_is_cut_short_by_a_step_waiting_behind_it(serve, oracle, streamed, heard):
    """A step sent with cut_prev while a burst runs ends that burst: heard
    during a sub-step's forward, before that forward's next layer (the
    sub-steps before it ran, and each of their parts went out); heard after
    a forward, before that sub-step's part goes out (it ran: its samples come
    in the whole). The burst returns what it ran (sub_steps_run) and carries
    its next sub-step into the step behind (sub_step_carried), which returns
    those rows' samples after its own; the rows' tables count what was
    computed, and every sequence, cut or not, goes on exactly (the stopped
    forward's K/V writes are overwritten)."""
    import time

    from executor_service import metrics

    served = serve(CKPT)
    runner = served.executor.runner
    forward = runner.forward
    stopped = metrics.FORWARDS.labels(served.executor.executor_id, "stopped")
    stopped_before = stopped._value.get()
    plan = Plan(served)
    ps = prompts(3, [6, 9, 4], seed=37)
    seqs = [plan.new_seq(p) for p in ps]
    lens = [len(s.tokens) for s in seqs]
    plan.prefill(seqs)
    bursting, waiting = seqs[:2], seqs[2]
    items = [(bursting[0], 8), (bursting[1], 3)]
    req = _burst_request(plan, items, 8)

    def slow(*args):  # a burst of 8 takes 0.8 s: the step behind comes well inside it
        if heard == "mid_forward":
            time.sleep(0.1)  # the cut comes now, inside the forward
            batch = args[0]
            if batch.stop is not None:  # heard before the second layer: the first has written its K/V
                ask, layer = batch.stop, iter(range(1 << 30))
                batch.stop = lambda: next(layer) >= 1 and ask()
            return forward(*args)
        logits = forward(*args)
        time.sleep(0.1)  # after the last layer: only the check between sub-steps hears the cut
        return logits

    runner.forward = slow
    try:
        call = (served.stub.ExecuteStream if streamed else served.stub.Execute.future)(req, timeout=120)
        time.sleep(0.15)  # a sub-step or two in
        behind = plan.request([(waiting, 1)])
        behind.prev_step_id, behind.cut_prev = req.step_id, True
        after = served.stub.Execute.future(behind, timeout=120)
        msgs = list(call) if streamed else [call.result()]
        resp = msgs[-1]
        after = after.result()
    finally:
        runner.forward = forward
    cut = resp.sub_steps_run
    assert 1 <= cut < 8, cut
    assert resp.sub_step_carried
    if streamed:  # mid-forward: every sub-step that ran sent its part; between: the last one's never went out
        sent = cut if heard == "mid_forward" else cut - 1
        assert [(m.partial, m.sub_step) for m in msgs[:-1]] == [(True, j) for j in range(sent)], msgs
    assert stopped._value.get() - stopped_before == (heard == "mid_forward")
    plan.sent_tables(req, items)
    sampled = list(packed.unpack_i32(resp.sampled_token_ids))
    assert len(sampled) == min(8, cut) + min(3, cut)
    carried = [seq for seq, q in items if q > cut]  # their next token was computed by the step behind
    behind_sampled = list(packed.unpack_i32(after.sampled_token_ids))
    assert len(behind_sampled) == 1 + len(carried)
    assert list(packed.unpack_i32(after.top_offsets)) == [0] * (2 + len(carried))
    pos = 0
    for seq, q in items:
        n = min(q, cut)
        seq.num_computed += n + (seq in carried)
        seq.tokens.extend(sampled[pos:pos + n])
        keep = -(-seq.num_computed // plan.block_size)  # the executor's table keeps the blocks they fill
        plan.alloc.release(seq.blocks[keep:])  # and the memory service frees the rest
        del seq.blocks[keep:]
        plan.sent[seq.seq_id] = (list(seq.blocks), seq.num_computed)  # what the executor's table holds now
        tables = served.executor.tables
        assert (tables.table(seq.seq_id), tables.computed(seq.seq_id)) == plan.sent[seq.seq_id]
        pos += n
    plan.sent_tables(behind, [(waiting, 1)])
    waiting.num_computed += 1
    waiting.tokens.append(behind_sampled[0])
    for seq, token in zip(carried, behind_sampled[1:]):
        seq.tokens.append(token)
    plan.decode(seqs, 3)  # context lens as the executor counts them: refused were they not
    for s, n in zip(seqs, lens):
        assert s.tokens[n:] == oracle(CKPT).greedy(s.tokens[:n], len(s.tokens) - n)


def test_a_step_refused_when_it_should_carry_the_cut_bursts_sub_step_voids_the_tables(serve):
    """The burst cut short counts its carried token as computed; the step that
    cut it is refused (a token id past the vocabulary), so that token never
    will be: the executor says INVALID_ARGUMENT, forgets every table and
    starts a new pool generation (what the memory service knew of the pool
    is void)."""
    import time

    served = serve(CKPT)
    executor = served.executor
    runner = executor.runner
    forward = runner.forward
    plan = Plan(served)
    seqs = [plan.new_seq(p) for p in prompts(2, [6, 4], seed=38)]
    plan.prefill(seqs)
    generation = executor.pool_generation
    req = _burst_request(plan, [(seqs[0], 8)], 8)

    def slow(*args):
        time.sleep(0.1)
        return forward(*args)

    runner.forward = slow
    try:
        call = served.stub.Execute.future(req, timeout=120)
        time.sleep(0.15)
        behind = plan.request([(seqs[1], 1)])
        behind.prev_step_id, behind.cut_prev = req.step_id, True
        behind.token_ids = packed.pack_i32([10 ** 6])
        with pytest.raises(grpc.RpcError) as err:
            served.stub.Execute(behind, timeout=120)
        resp = call.result()
    finally:
        runner.forward = forward
    assert resp.sub_steps_run and resp.sub_step_carried
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert executor.pool_generation == generation + 1 and executor._carry is None
    assert seqs[0].seq_id not in executor.tables and seqs[1].seq_id not in executor.tables
