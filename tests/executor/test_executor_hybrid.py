"""The hybrid KV layout end to end on the data plane: the executor keeps a
table per KV group (pool slots shared between one layer of each group) and
the real group allocator frees sliding blocks the window passed, yet greedy
output stays token-for-token identical to transformers' ``generate`` for
Mistral, Qwen2, Gemma 2 and Gemma 3 — with prompts of 3-4 windows and 42 new tokens,
chunked prefill, a prefix hit, preemption by recompute and by swap, and a
fork with copy-on-write."""

from __future__ import annotations

import pytest
from executor_harness import WINDOW, prompts
from group_harness import GroupPlan

FAMILIES = ["mistral_swa", "qwen2_swa", "gemma2", "gemma3"]
NEW = 42
BLOCKS = 192


@pytest.fixture
def hybrid(serve):
    def get(name: str, backend: str = "cpu"):
        if backend == "cpu":
            from kvpager_kernels import cpu_attention

            if not cpu_attention.available():
                pytest.skip("the C++ CPU attention kernel did not build here")
        return serve(name, backend, kv_layout="hybrid", num_blocks=BLOCKS)

    return get


def _bounded(plan: GroupPlan, seqs) -> None:
    for seq in seqs:
        for g, spec in enumerate(plan.groups):
            held = plan.kv.num_held(seq, g)
            if spec.window is None:
                assert held == -(-seq.num_computed // plan.kv.block_size)
            else:
                assert held <= -(-spec.window // plan.kv.block_size) + 1


def _decode(plan, seqs, n):
    for _ in range(n):
        plan.step([(s, 1) for s in seqs])
        _bounded(plan, seqs)


@pytest.mark.parametrize("ckpt", FAMILIES)
def test_layout_and_groups(hybrid, ckpt):
    info = hybrid(ckpt).info
    groups = [(g.window, list(g.layers)) for g in info.kv_groups]
    assert info.kv_layout == "hybrid"
    assert groups == {"mistral_swa": [(WINDOW, [0, 1])],
                      "qwen2_swa": [(0, [0]), (WINDOW, [1]), (WINDOW, [2])],
                      "gemma2": [(0, [1]), (WINDOW, [0]), (WINDOW, [2])],
                      "gemma3": [(0, [2]), (WINDOW, [0]), (WINDOW, [1])]}[ckpt]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("ckpt", FAMILIES)
def test_window_frees_chunked_prefill_and_prefix_hit(hybrid, oracle, ckpt, backend):
    plan = GroupPlan(hybrid(ckpt, backend))
    [prefix] = prompts(1, [3 * WINDOW], seed=31)
    a = plan.new_seq(prefix + [5, 6, 7, 8, 9])
    k = plan.admit(a, 20)                                    # chunked: 20, then the rest
    plan.step([(a, k)], grow=False)
    plan.step([(a, len(a.token_ids) - a.num_computed)])
    _decode(plan, [a], NEW - 1)
    assert plan.generated(a) == oracle(ckpt).greedy(prefix + [5, 6, 7, 8, 9], NEW)
    b = plan.new_seq(prefix + [40, 41, 42])
    k = plan.admit(b, 100)
    assert b.num_computed == 3 * WINDOW                      # the hit: every group holds what it needs
    plan.step([(b, k)], grow=False)
    _decode(plan, [a, b], NEW - 1)
    assert plan.generated(b) == oracle(ckpt).greedy(prefix + [40, 41, 42], NEW)
    plan.free(a)
    plan.free(b)


@pytest.mark.parametrize("ckpt", FAMILIES)
def test_recompute_swap_and_fork(hybrid, oracle, ckpt):
    plan = GroupPlan(hybrid(ckpt))
    pa, pb = prompts(2, [4 * WINDOW - 2, 3 * WINDOW + 1], seed=32)
    a, b = plan.new_seq(pa), plan.new_seq(pb)
    plan.step([(a, plan.admit(a, 200))], grow=False)
    plan.step([(b, plan.admit(b, 200))], grow=False)
    _decode(plan, [a, b], 10)
    # a: preempted by recompute, re-admitted on its own cached blocks; b: swapped out and back.
    plan.swap_out(b)
    k = plan.recompute(a, 200)
    assert a.num_computed > 0
    plan.step([(a, k)], grow=False)
    plan.swap_in(b)
    _decode(plan, [a, b], 10)
    # A fork whose child takes another token: the shared partial tail is copied, per group.
    child = plan.fork(b)
    child.token_ids[-1] = (child.token_ids[-1] + 1) % 300 + 3
    _decode(plan, [a, b, child], NEW - 21)
    assert plan.generated(a) == oracle(ckpt).greedy(pa, NEW + 1)  # its re-prefill sampled one more
    assert plan.generated(b) == oracle(ckpt).greedy(pb, NEW)
    start = len(pb) + 21
    assert child.token_ids[start:] == oracle(ckpt).greedy(child.token_ids[:start], NEW - 21)
    for s in (a, b, child):
        plan.free(s)


def test_auto_layout_and_the_pool_length_it_allows():
    from executor_service.kv_layout import make_layout, pool_tokens

    assert make_layout("auto", [None, None]).name == "per-layer"
    gemma = make_layout("auto", [32, None, 32, None])  # alternating: a full and a sliding group of 2 layers
    assert gemma.name == "hybrid" and [g.window for g in gemma.groups] == [None, 32]
    assert pool_tokens(make_layout("per-layer", [32, None]), 100, 4) == 400
    # A sliding group needs its window's blocks and the one written (+1 slack): 8 + 2; the full group the rest.
    assert pool_tokens(gemma, 100, 4) == (100 - 10) * 4
    assert pool_tokens(make_layout("auto", [32, 32]), 10, 4) == 1 << 30  # all sliding: any length
    assert pool_tokens(make_layout("auto", [32, 32]), 9, 4) == 0         # not even one window
