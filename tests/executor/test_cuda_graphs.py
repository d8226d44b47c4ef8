"""Decode CUDA graphs (executor_service.cuda_graphs): padded static-buffer
replays give the eager forward's logits and K/V, and padding writes nothing.

Off CUDA the mechanism runs with ``RerunGraph`` in place of a CUDA graph: its
replay runs the captured forward again on the static buffers and writes the
result into the tensor the capture returned, which is what a graph replay
does. The same cases run with real graphs on a CUDA machine
(``TRITON_INTERPRET=0 python -m pytest -m gpu tests/executor/test_cuda_graphs.py``).
"""

from __future__ import annotations

import pytest
import torch

from executor_harness import triton_available
from executor_service.attention import load_backend
from executor_service.config import ExecutorConfig
from executor_service.cuda_graphs import DecodeGraphs, cuda_graph_factory, graph_batch_sizes, graphs_apply
from executor_service.model_runner import ForwardBatch, ModelRunner

BS = 4          # tokens per block
NUM_BLOCKS = 64
MAX_LEN = 64    # tokens: the static tables are MAX_LEN // BS wide


class RerunGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph`` (see the module docstring)."""

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        with torch.inference_mode():  # the captured output is an inference tensor
            self.out.copy_(self.fn())


def _cuda_compiled() -> bool:
    from executor_service.cuda_graphs import triton_interpreted

    return torch.cuda.is_available() and triton_available() and not triton_interpreted()


KINDS = [
    pytest.param("rerun", id="rerun-cpu"),
    pytest.param("cuda", id="cuda-graph", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _cuda_compiled(), reason="needs CUDA and TRITON_INTERPRET=0")]),
]


# ---------------------------------------------------------------- policy


def test_graph_batch_sizes_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))
    with pytest.raises(ValueError, match="max_batch"):
        graph_batch_sizes(0)


def test_graphs_apply_only_to_triton_and_our_forward_on_cuda():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_apply(cuda, "triton", "kvpager", False) is None
    assert graphs_apply(cuda, "triton", "kvpager", True) == "enforce_eager"
    assert graphs_apply(cpu, "cpu", "kvpager", False) == "device cpu"
    assert graphs_apply(cuda, "torch", "kvpager", False) == "attention backend torch"
    assert graphs_apply(cuda, "triton", "transformers", False) == "model_impl transformers"
    assert graphs_apply(cuda, "triton", "kvpager", False, interpreted=True).startswith("triton interpreter")


def test_config_and_cli_carry_the_graph_settings(tmp_path):
    from argparse import ArgumentParser

    from executor_service.cli import add_arguments, config_from_args

    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        ExecutorConfig(model="m", cuda_graph_max_batch=0)
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        ExecutorConfig(model="m", cuda_graph_max_batch=4096)
    p = ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--model", str(tmp_path), "--enforce-eager",
                                         "--cuda-graph-max-batch", "64"]))
    assert (cfg.enforce_eager, cfg.cuda_graph_max_batch) == (True, 64)
    cfg = config_from_args(p.parse_args(["--model", str(tmp_path)]))
    assert (cfg.enforce_eager, cfg.cuda_graph_max_batch) == (False, 256)


def test_an_executor_on_cpu_captures_nothing_and_says_so(checkpoints):
    from executor_service import metrics
    from executor_service.executor import Executor

    ex = Executor(ExecutorConfig(model=checkpoints("llama_gqa"), executor_id="graphs-cpu", num_blocks=16,
                                 block_size=BS, device="cpu", dtype="float32"))
    assert ex.graphs is None
    assert metrics.CUDA_GRAPHS.labels("graphs-cpu")._value.get() == 0


# ---------------------------------------------------------------- mechanism


def _batch(rows, device, width: int | None = None, groups: int = 1) -> ForwardBatch:
    """rows: (context_len, new token ids, block ids of each table group). One
    table per group; token p of a row goes to its group table's block p // BS."""
    width = width or max(len(t) for _, _, tables in rows for t in tables)
    ids, pos, lens, qsl = [], [], [], [0]
    slots = [[] for _ in range(groups)]
    tables = torch.zeros(groups, len(rows), width, dtype=torch.int32)
    for i, (ctx, toks, row_tables) in enumerate(rows):
        for g, blocks in enumerate(row_tables):
            tables[g, i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for j, tok in enumerate(toks):
            p = ctx + j
            ids.append(tok)
            pos.append(p)
            for g, blocks in enumerate(row_tables):
                slots[g].append(blocks[p // BS] * BS + p % BS)
        lens.append(ctx + len(toks))
        qsl.append(qsl[-1] + len(toks))

    def t(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    group_tables = [tables[g].to(device) for g in range(groups)]
    group_slots = [t(s, torch.int32) for s in slots]
    return ForwardBatch(
        input_ids=t(ids, torch.int64), positions=t(pos, torch.int64), slot_mapping=group_slots[0],
        block_tables=group_tables[0], seq_lens=t(lens, torch.int32), query_start_loc=t(qsl, torch.int32),
        logits_indices=t([q - 1 for q in qsl[1:]], torch.int64), group_block_tables=group_tables,
        group_slot_mappings=group_slots,
    )


class Setup:
    """A model, a zeroed pool, sequences with blocks of their own in each table group."""

    def __init__(self, ckpt: str, kind: str, backend: str, groups: int) -> None:
        device = "cuda" if kind == "cuda" else "cpu"
        self.runner = ModelRunner(ckpt, device=device, dtype="float32", model_impl="kvpager")
        self.backend = load_backend(backend)
        self.device = self.runner.device
        r = self.runner
        self.kv = torch.zeros((r.num_layers, 2, NUM_BLOCKS, BS, r.num_kv_heads, r.head_dim), device=self.device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(r.num_layers)]
        self.groups = groups
        # Layer i reads table group i % groups: with 2 groups the layers' K/V
        # live in different blocks and each must follow its own table.
        self.layer_groups = tuple(i % groups for i in range(r.num_layers)) if groups > 1 else None
        self.next_block = 1  # block 0 is left as the padding rows' key
        gen = torch.Generator().manual_seed(5)
        self.tokens = lambda n: torch.randint(3, 300, (n,), generator=gen).tolist()

    def blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def new_seqs(self, lengths: list[int]) -> list[dict]:
        """Prefilled eagerly; each gets blocks for its prompt plus room for 3 decodes per group."""
        seqs = [dict(ctx=0, prompt=self.tokens(n),
                     tables=[self.blocks(-(-(n + 3) // BS)) for _ in range(self.groups)]) for n in lengths]
        self.forward(_batch([(0, s["prompt"], s["tables"]) for s in seqs], self.device, groups=self.groups))
        for s in seqs:
            s["ctx"] = len(s["prompt"])
        return seqs

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.runner.forward(batch, self.kv_caches, self.backend, self.layer_groups)

    def graphs(self, kind: str, max_batch: int) -> DecodeGraphs:
        new_graph = cuda_graph_factory() if kind == "cuda" else RerunGraph
        return DecodeGraphs(self.runner, self.kv_caches, self.backend, self.layer_groups, num_groups=self.groups,
                            max_blocks_per_seq=MAX_LEN // BS, max_batch=max_batch, new_graph=new_graph)


CASES = [  # (checkpoint, attention backend, table groups)
    pytest.param("llama_gqa", "torch", 1, id="llama-torch"),
    pytest.param("llama_gqa", "triton", 1, id="llama-triton"),
    pytest.param("llama_gqa", "triton", 2, id="llama-triton-2-groups"),
    pytest.param("mistral_swa", "triton", 1, id="sliding-window-triton"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("ckpt", "backend", "groups"), CASES)
def test_padded_replays_match_eager_decodes(checkpoints, kind, ckpt, backend, groups):
    if backend == "triton" and not triton_available():
        pytest.skip("triton is not importable here")
    if kind == "cuda" and backend != "triton":
        pytest.skip("graphs on CUDA go with the triton backend")
    s = Setup(checkpoints(ckpt), kind, backend, groups)
    seqs = s.new_seqs([5, 11, 18])  # 18 tokens + 3 decodes: past the 16-token sliding window
    before = s.kv.clone()
    graphs = s.graphs(kind, max_batch=4)
    assert graphs.sizes == [1, 2, 4]
    # The warm-ups and captures ran padding only: nothing was written.
    assert torch.equal(s.kv, before)
    tol = dict(atol=1e-4, rtol=1e-4)
    # 3 rows pad to 4, then 1 row (a graph of its own), then 2 rows whose
    # tables are narrower than the last step's (stale columns stay behind).
    for step, rows in enumerate(([0, 1, 2], [2], [1, 0])):
        batch = _batch([(seqs[i]["ctx"], [seqs[i]["prompt"][step]], seqs[i]["tables"]) for i in rows],
                       s.device, groups=groups)
        assert graphs.fits(batch)
        before = s.kv.clone()
        eager = s.forward(batch)                 # writes this step's K/V ...
        eager_kv = s.kv.clone()
        s.kv.copy_(before)                       # ... undone, and written again by the replay
        replayed = graphs.replay(batch)
        assert replayed.shape == eager.shape
        torch.testing.assert_close(replayed, eager, **tol)
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
        # Only the live rows' slots changed: the padding wrote no K/V.
        changed = (s.kv != before).flatten(3).any(-1)  # [L, 2, NB, BS]
        expected = (eager_kv != before).flatten(3).any(-1)
        assert torch.equal(changed, expected) and int(expected.sum()) > 0
        torch.testing.assert_close(s.kv, eager_kv, **tol)
        for i in rows:
            seqs[i]["ctx"] += 1


@pytest.mark.parametrize("kind", KINDS)
def test_only_decode_batches_that_fit_replay(checkpoints, kind):
    s = Setup(checkpoints("llama_gqa"), kind, "triton" if kind == "cuda" else "torch", 1)
    seqs = s.new_seqs([4, 6, 7])
    graphs = s.graphs(kind, max_batch=2)
    decode = [(q["ctx"], [1], q["tables"]) for q in seqs]
    assert graphs.fits(_batch(decode[:2], s.device))
    assert not graphs.fits(_batch(decode, s.device))                                 # 3 rows > 2
    assert not graphs.fits(_batch([(0, [1, 2], seqs[0]["tables"])], s.device))       # a prefill row
    assert not graphs.fits(_batch(decode[:1], s.device, width=MAX_LEN // BS + 1))   # wider than the buffers
    with pytest.raises(ValueError, match="fits"):
        graphs.replay(_batch(decode, s.device))


# ---------------------------------------------------------------- the executor on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_compiled(), reason="needs CUDA and TRITON_INTERPRET=0")
def test_executor_decodes_replay_graphs_with_eager_tokens(serve):
    from executor_harness import Plan, prompts
    from executor_service import metrics

    graphed = serve("llama_gqa", "triton", device="cuda", executor_id="graphs-cuda", cuda_graph_max_batch=8)
    eager = serve("llama_gqa", "triton", device="cuda", executor_id="eager-cuda", enforce_eager=True)
    assert graphed.executor.graphs is not None and eager.executor.graphs is None
    assert metrics.CUDA_GRAPHS.labels("graphs-cuda")._value.get() == 4  # sizes 1, 2, 4 and 8
    replays = metrics.FORWARDS.labels("graphs-cuda", "graph")
    before = replays._value.get()
    generated = []
    for served in (graphed, eager):
        plan = Plan(served)
        seqs = [plan.new_seq(p) for p in prompts(3, [5, 9, 14], seed=21)]
        plan.prefill(seqs)
        plan.decode(seqs, 5)
        generated.append([s.generated for s in seqs])
    assert generated[0] == generated[1]
    assert replays._value.get() - before == 5  # every decode step replayed a graph


# ---------------------------------------------------------------- capture safety

# Tensor methods / torch functions that read a value back to the host (or
# size an output by the data): a CUDA graph capture fails on them.
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
              "unique", "masked_select", "repeat_interleave", "argwhere", "bincount"}


class NoHostReads(torch.overrides.TorchFunctionMode):
    """Fails any torch call in HOST_READS, except inside the kernel launchers
    (``paused``): the Triton interpreter copies their arguments to the host
    by design, and the compiled launchers read shapes only."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        self.seen.add(name)
        if not self.paused and (name in HOST_READS or (name == "to" and "cpu" in map(str, args[1:]))):
            raise AssertionError(f"{name}: reads a device value on the host inside a captured forward")
        return func(*args, **(kwargs or {}))


class CheckedCapture(RerunGraph):
    """Captures (and replays) under ``NoHostReads``."""

    def __init__(self, mode: NoHostReads) -> None:
        self.mode = mode

    def capture(self, fn):
        with self.mode:
            return super().capture(fn)


def _paused(mode: NoHostReads, fn):
    def call(*args, **kwargs):
        mode.paused = True
        try:
            return fn(*args, **kwargs)
        finally:
            mode.paused = False

    return call


@pytest.mark.skipif(not triton_available(), reason="triton is not importable here")
@pytest.mark.parametrize(("ckpt", "groups"), [("llama_gqa", 1), ("qwen2", 2), ("mistral_swa", 1)])
def test_the_captured_forward_reads_nothing_back_to_the_host(checkpoints, ckpt, groups):
    import dataclasses

    s = Setup(checkpoints(ckpt), "rerun", "triton", groups)
    mode = NoHostReads()
    backend = s.backend
    s.backend = dataclasses.replace(backend, store_kv=_paused(mode, backend.store_kv),
                                    paged_attention=_paused(mode, backend.paged_attention))
    DecodeGraphs(s.runner, s.kv_caches, s.backend, s.layer_groups, num_groups=groups,
                 max_blocks_per_seq=MAX_LEN // BS, max_batch=2, new_graph=lambda: CheckedCapture(mode))
    # The check saw the model's own ops (so it was on), and would have caught a host read.
    assert {"embedding", "index_select", "float"} <= mode.seen
    with pytest.raises(AssertionError, match="item"), mode:
        torch.ones(1).item()


def test_no_memory_for_graphs_means_eager_steps_not_a_failed_start(checkpoints, monkeypatch):
    from executor_service import cuda_graphs

    class OutOfMemory(RerunGraph):
        def capture(self, fn):
            raise torch.OutOfMemoryError("CUDA out of memory (test)")

    s = Setup(checkpoints("llama_gqa"), "rerun", "torch", 1)
    # As on CUDA: graphs apply, and the capture runs out of memory.
    monkeypatch.setattr(cuda_graphs, "graphs_apply", lambda *args, **kw: None)
    monkeypatch.setattr(cuda_graphs, "cuda_graph_factory", lambda: OutOfMemory)
    graphs = cuda_graphs.capture_decode_graphs(s.runner, s.kv_caches, s.backend, None, num_groups=1,
                                               max_model_len=MAX_LEN, block_size=BS, max_batch=4,
                                               enforce_eager=False)
    assert graphs is None
    monkeypatch.setattr(cuda_graphs, "cuda_graph_factory", lambda: RerunGraph)
    graphs = cuda_graphs.capture_decode_graphs(s.runner, s.kv_caches, s.backend, None, num_groups=1,
                                               max_model_len=MAX_LEN, block_size=BS, max_batch=4,
                                               enforce_eager=False)
    assert graphs is not None and graphs.sizes == [1, 2, 4] and graphs.max_blocks_per_seq == MAX_LEN // BS
