"""Steps planned ahead: a decode's input token is the executor's own sample
from the step before (placeholder -1 + prev_step_id). The pipelined run
gives the same greedy tokens as transformers' generate, whichever of the two
Executes arrives first; a plan out of step is refused and changes nothing."""

from __future__ import annotations

import grpc
import pytest

from executor_harness import Plan, prompts
from kvpager import packed

CKPT = "llama_gqa"
NEW = 5


def _ahead(plan: Plan, prev, prev_items, seqs):
    """The decode step after ``prev`` (sent, not yet returned): each sequence's
    next token is the placeholder for what ``prev`` samples."""
    plan.sent_tables(prev, prev_items)
    for s, q in prev_items:
        s.num_computed += q
    for s in seqs:
        s.tokens.append(-1)
    items = [(s, 1) for s in seqs]
    req = plan.request(items)
    req.prev_step_id = prev.step_id
    for s in seqs:
        s.tokens.pop()
    return req, items


def _append(seqs, resp) -> None:
    for s, tok in zip(seqs, packed.unpack_i32(resp.sampled_token_ids)):
        s.tokens.append(tok)


def _pipelined_run(served, seqs, plan: Plan, reverse: bool = False) -> None:
    """Prefill, then NEW - 1 decodes, each sent before the previous one has returned."""
    items = [(s, len(s.tokens)) for s in seqs]
    prev = plan.request(items)
    future = served.stub.Execute.future(prev, timeout=60)
    for _ in range(NEW - 1):
        req, next_items = _ahead(plan, prev, items, seqs)
        if reverse:  # the step planned ahead reaches the executor first: it waits for its predecessor
            next_future = served.stub.Execute.future(req, timeout=60)
            _append(seqs, future.result())
        else:
            _append(seqs, future.result())
            next_future = served.stub.Execute.future(req, timeout=60)
        prev, items, future = req, next_items, next_future
    _append(seqs, future.result())


@pytest.mark.parametrize("reverse", [False, True], ids=["in-order", "ahead-first"])
def test_pipelined_decodes_match_generate(serve, oracle, reverse):
    served = serve(CKPT, "cpu") if _cpu() else serve(CKPT)
    plan = Plan(served)
    seqs = [plan.new_seq(p) for p in prompts(3, [5, 9, 2], seed=21)]
    prompt_lens = [len(s.tokens) for s in seqs]
    _pipelined_run(served, seqs, plan, reverse)
    for s, n in zip(seqs, prompt_lens):
        assert s.tokens[n:] == oracle(CKPT).greedy(s.tokens[:n], NEW)


def test_placeholder_refused_when_out_of_step(serve):
    served = serve(CKPT)
    plan = Plan(served)
    [seq] = [plan.new_seq(p) for p in prompts(1, [4], seed=22)]
    first = plan.request([(seq, 4)])
    served.stub.Execute(first, timeout=60)
    req, _ = _ahead(plan, first, [(seq, 4)], [seq])
    req.prev_step_id = 0  # a placeholder without the step it comes from
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # another step ran in between: the samples of `first` are gone
    seq.tokens.append(11)
    plan.step([(seq, 1)])
    req.prev_step_id = first.step_id
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"takes its tokens from step {first.step_id}" in err.value.details()
    plan.decode([seq], 2)  # and the executor is unharmed
    assert len(seq.tokens) == 4 + 1 + 1 + 2


def test_placeholder_only_as_a_decode_token(serve):
    served = serve(CKPT)
    plan = Plan(served)
    [seq] = [plan.new_seq(p) for p in prompts(1, [4], seed=23)]
    prev = plan.request([(seq, 4)])
    served.stub.Execute(prev, timeout=60)
    plan.sent_tables(prev, [(seq, 4)])
    seq.num_computed = 4
    seq.tokens += [-1, 7]  # a two-token chunk holding a placeholder
    req = plan.request([(seq, 2)])
    req.prev_step_id = prev.step_id
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "decode row" in err.value.details()


def _cpu() -> bool:
    from kvpager_kernels import cpu_build

    return cpu_build.available()


@pytest.mark.parametrize("method", ["Execute", "ExecuteStream"])
def test_a_step_naming_its_predecessor_runs_after_it_without_placeholders(serve, oracle, method):
    """prev_step_id orders steps even when no token of the later one is a
    placeholder (a prefill planned while a decode burst runs): arriving first,
    it waits for its predecessor to be handed over, then runs after it."""
    from kvpager.v1 import executor_pb2

    import time

    served = serve(CKPT)
    plan = Plan(served)
    plan.step_id = int(time.time() * 1000) << 8  # above any step this (shared) executor has been handed
    a, b = [plan.new_seq(p) for p in prompts(2, [6, 4], seed=24)]
    first = plan.request([(a, len(a.tokens))])
    plan.sent_tables(first, [(a, len(a.tokens))])
    a.num_computed = len(a.tokens)
    second = plan.request([(b, len(b.tokens))])
    second.prev_step_id = first.step_id
    call = getattr(served.stub, method)
    later = (call.future(second, timeout=60) if method == "Execute"
             else served.stub.ExecuteStream(second, timeout=60))
    time.sleep(0.2)  # the later step is at the executor, waiting
    got_a = packed.unpack_i32(served.stub.Execute(first, timeout=60).sampled_token_ids)
    resp = later.result() if method == "Execute" else list(later)[-1]
    got_b = packed.unpack_i32(resp.sampled_token_ids)
    assert [list(got_a), list(got_b)] == [oracle(CKPT).greedy(a.tokens, 1), oracle(CKPT).greedy(b.tokens, 1)]
    confirm = served.stub.ConfirmPool(executor_pb2.ConfirmPoolRequest(), timeout=10)
    assert confirm.last_step_id == second.step_id  # it ran last
