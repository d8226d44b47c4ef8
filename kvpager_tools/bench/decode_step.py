"""One realistic decode step of the memory core, timed side by side with
nano-vllm's block manager (`kvpager bench memory --nanovllm DIR`).

The workload: ``batch`` sequences decoding one token per step, prompts
uniform in [prompt_lo, prompt_hi] tokens, so about 1/block_size of the
sequences open a new block (and hash a newly full one) in any step; a pool
large enough that nothing is preempted. Every contender gets the same
prompts and the same sampled tokens, runs in this process, and the
contenders alternate step by step (the order turns every step) so that
noise from the shared machine lands on all of them alike.

Contenders:

* ``kvpager``: ``MemoryManager.step`` on the StepInput the servicer would
  build (packed arrays): validation, appends, allocation with the
  copy-on-write check, commit (SHA-256 and the token copy of a newly full
  block), the executor plan.
* ``kvpager_split``: the same step on its own manager, with a clock read
  between its phases (validation / apply / schedule / plan building).
* ``nanovllm``: nano-vllm's ``BlockManager`` + ``Sequence``, loaded from the
  user's checkout (never vendored): per sequence can_append / may_append,
  the slot of the new token, hash_blocks (xxh64 of a newly full block), the
  cached-token count, append_token — what its scheduler and postprocess do
  for a decode, less the model.
* ``nanovllm_tables``: the same plus its model runner's decode inputs that
  concern the block manager: context lengths and block tables padded to the
  longest (as Python lists; the torch copies are left out).

nano-vllm's modules import ``nanovllm.sampling_params`` and ``xxhash``:
the package is stubbed for the load only (its real ``sampling_params.py`` is
loaded when present), xxhash must be installed (``pip install xxhash``).
"""

from __future__ import annotations

import gc
import importlib.util
import random
import statistics
import sys
import time
import types
from array import array
from dataclasses import dataclass
from pathlib import Path

from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.records import NewSeq, StepInput, StepOutput

VOCAB = 32000


@dataclass
class DecodeWorkload:
    batch: int = 256
    prompt_lo: int = 100
    prompt_hi: int = 500
    block_size: int = 16
    steps: int = 200
    runs: int = 3
    seed: int = 0

    def prompts(self, run: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1000 + run)
        return [[rng.randrange(VOCAB) for _ in range(rng.randint(self.prompt_lo, self.prompt_hi))]
                for _ in range(self.batch)]

    def sampled(self, run: int) -> list[list[int]]:
        """sampled[i][j]: the token sequence j samples in step i (step 0: the prefill's)."""
        rng = random.Random(self.seed * 1000 + run + 500)
        return [[rng.randrange(VOCAB) for _ in range(self.batch)] for _ in range(self.steps + 1)]

    @property
    def num_blocks(self) -> int:
        return self.batch * (-(-(self.prompt_hi + self.steps + 1) // self.block_size) + 4)

    def describe(self) -> dict:
        return {"batch": self.batch, "prompt_len": [self.prompt_lo, self.prompt_hi], "block_size": self.block_size,
                "steps": self.steps, "runs": self.runs, "num_blocks": self.num_blocks}


# ---- kvpager ------------------------------------------------------------------------


class KvpagerDecode:
    """One MemoryManager, its sequences prefilled; step(i) runs decode step i."""

    def __init__(self, w: DecodeWorkload, prompts: list[list[int]], sampled: list[list[int]]) -> None:
        self.m = MemoryManager()
        self.m.register_executor(ExecutorSpec("e0", w.num_blocks, w.block_size, max_model_len=4096,
                                              vocab_size=VOCAB))
        n = w.batch
        new = [NewSeq(i, "e0", array("i", p)) for i, p in enumerate(prompts)]
        out = self.m.step(StepInput(step_id=1, new_seqs=new, schedule_seq_ids=array("q", range(n)),
                                    schedule_num_tokens=array("i", map(len, prompts))))
        assert not out.unscheduled and not out.preempted
        ids = array("q", range(n))
        offsets = array("i", range(n + 1))
        ones = array("i", [1] * n)
        # what the servicer hands the manager: fresh packed arrays per step
        self.requests = [StepInput(step_id=i + 2, appended_seq_ids=array("q", ids),
                                   appended_offsets=array("i", offsets), appended_tokens=array("i", sampled[i]),
                                   schedule_seq_ids=array("q", ids), schedule_num_tokens=array("i", ones))
                         for i in range(len(sampled))]

    def step(self, i: int) -> StepOutput:
        return self.m.step(self.requests[i])


PHASES = ("validation", "apply", "schedule", "plan")


def split_step(m: MemoryManager, step: StepInput, clock=time.perf_counter) -> tuple[StepOutput, list[float]]:
    """MemoryManager.step's phases one by one, timed: the same calls step makes
    (kept beside it: a change there shows up here as a failing smoke test)."""
    t0 = clock()
    decode = m.validator.check_decode(step)
    if decode is None:
        m.validator.check(step)
    t1 = clock()
    out = StepOutput(step.step_id)
    rejected = m.apply(step, out, decode)
    t2 = clock()
    rows = m.planner.schedule(step, out, rejected, decode)
    t3 = clock()
    m.planner.build_plans(rows, out)
    t4 = clock()
    m.last_step_id = step.step_id
    m._last_output = out
    return out, [t1 - t0, t2 - t1, t3 - t2, t4 - t3]


# ---- nano-vllm ------------------------------------------------------------------------


def load_nanovllm(root: str | Path) -> tuple[type, type]:
    """(BlockManager, Sequence) from a nano-vllm checkout's
    nanovllm/engine/{block_manager,sequence}.py, loaded as files: no torch,
    nothing else of the package. The modules' own imports of the package are
    satisfied by stand-ins that live only for the load."""
    engine = Path(root) / "nanovllm" / "engine"
    files = {name: engine / f"{name}.py" for name in ("sequence", "block_manager")}
    for path in files.values():
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not a nano-vllm checkout (want nanovllm/engine/*.py)")
    names = ("nanovllm", "nanovllm.engine", "nanovllm.sampling_params", "nanovllm.engine.sequence",
             "nanovllm.engine.block_manager")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for name in names[:2]:
            pkg = types.ModuleType(name)
            pkg.__path__ = []
            sys.modules[name] = pkg
        sp_file = Path(root) / "nanovllm" / "sampling_params.py"
        if sp_file.is_file():
            _load("nanovllm.sampling_params", sp_file)
        else:
            stub = types.ModuleType("nanovllm.sampling_params")

            @dataclass
            class SamplingParams:
                temperature: float = 1.0
                max_tokens: int = 64
                ignore_eos: bool = False

            stub.SamplingParams = SamplingParams
            sys.modules["nanovllm.sampling_params"] = stub
        seq_mod = _load("nanovllm.engine.sequence", files["sequence"])
        try:
            bm_mod = _load("nanovllm.engine.block_manager", files["block_manager"])
        except ModuleNotFoundError as exc:
            if exc.name == "xxhash":  # its block hash
                raise RuntimeError("--nanovllm needs xxhash (pip install xxhash)") from None
            raise
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return bm_mod.BlockManager, seq_mod.Sequence


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class NanoDecode:
    """nano-vllm's block manager and sequences on the same workload: prefilled
    as its scheduler would (allocate, compute, hash the full blocks, append the
    first sampled token), then one decode per step."""

    def __init__(self, classes: tuple[type, type], w: DecodeWorkload, prompts: list[list[int]],
                 sampled: list[list[int]], tables: bool = False) -> None:
        block_manager, sequence = classes
        sequence.block_size = w.block_size  # as its engine sets it from the config
        self.bs = w.block_size
        self.bm = bm = block_manager(w.num_blocks, w.block_size)
        self.seqs = []
        for prompt, tok in zip(prompts, sampled[0]):
            seq = sequence(prompt)
            cached = bm.can_allocate(seq)
            assert cached >= 0
            bm.allocate(seq, cached)
            seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
            bm.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            seq.is_prefill = False
            seq.append_token(tok)
            self.seqs.append(seq)
        self.sampled = sampled
        self.tables = tables

    def step(self, i: int):
        bm, bs, seqs = self.bm, self.bs, self.seqs
        slots = []
        for seq in seqs:  # Scheduler.schedule, decode
            if not bm.can_append(seq):
                raise AssertionError("the workload never preempts")
            seq.num_scheduled_tokens = 1
            bm.may_append(seq)
            slots.append(seq.block_table[-1] * bs + seq.last_block_num_tokens - 1)
        if self.tables:  # ModelRunner.prepare_decode / prepare_block_tables, as lists
            context_lens = [len(seq) for seq in seqs]
            max_len = max(len(seq.block_table) for seq in seqs)
            block_tables = [seq.block_table + [-1] * (max_len - len(seq.block_table)) for seq in seqs]
            slots = (slots, context_lens, block_tables)
        for seq, tok in zip(seqs, self.sampled[i + 1]):  # Scheduler.postprocess
            bm.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            seq.append_token(tok)
        return slots


# ---- side by side ------------------------------------------------------------------------


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def measure(w: DecodeWorkload, nanovllm_dir: str | None = None, progress=None) -> dict:
    """Per run: fresh contenders, `w.steps` steps alternating among them; the
    figures are medians over steps, then the median over runs."""
    nano = load_nanovllm(nanovllm_dir) if nanovllm_dir else None
    per_run: dict[str, list[float]] = {"kvpager": [], "nanovllm": [], "nanovllm_tables": []}
    split_runs: list[list[float]] = []
    clock = time.perf_counter
    for run in range(w.runs):
        if progress:
            progress(f"decode step: run {run + 1}/{w.runs}")
        prompts, sampled = w.prompts(run), w.sampled(run)
        kv = KvpagerDecode(w, prompts, sampled)
        kv_split = KvpagerDecode(w, prompts, sampled)
        steppers = [("kvpager", kv.step), ("kvpager_split", None)]
        if nano is not None:
            steppers.append(("nanovllm", NanoDecode(nano, w, prompts, sampled).step))
            steppers.append(("nanovllm_tables", NanoDecode(nano, w, prompts, sampled, tables=True).step))
        times: dict[str, list[float]] = {name: [] for name, _ in steppers}
        phases: list[list[float]] = [[] for _ in PHASES]
        gc.collect()
        for i in range(w.steps):
            turn = i % len(steppers)
            for name, fn in steppers[turn:] + steppers[:turn]:
                if fn is None:
                    _, parts = split_step(kv_split.m, kv_split.requests[i], clock)
                    for acc, t in zip(phases, parts):
                        acc.append(t)
                    continue
                t0 = clock()
                fn(i)
                times[name].append(clock() - t0)
        for m in (kv.m, kv_split.m):
            bad = m.check_invariants()
            assert not bad, bad[:3]
        for name in per_run:
            if name in times:
                per_run[name].append(_median_us(times[name]))
        split_runs.append([_median_us(p) for p in phases])
    kv_us = statistics.median(per_run["kvpager"])
    result = {"decode_workload": w.describe(),
              "decode_step_us": round(kv_us, 1),
              "decode_step_us_runs": [round(x, 1) for x in per_run["kvpager"]],
              "decode_split_us": {p: round(statistics.median(r[j] for r in split_runs), 1)
                                  for j, p in enumerate(PHASES)}}
    if nano is not None:
        nano_us = statistics.median(per_run["nanovllm"])
        tables_us = statistics.median(per_run["nanovllm_tables"])
        result.update({
            "nanovllm_step_us": round(nano_us, 1),
            "nanovllm_step_us_runs": [round(x, 1) for x in per_run["nanovllm"]],
            "nanovllm_tables_step_us": round(tables_us, 1),
            "ratio_vs_nanovllm": round(kv_us / nano_us, 3),
            "ratio_vs_nanovllm_runs": [round(a / b, 3) for a, b in zip(per_run["kvpager"], per_run["nanovllm"])],
            "ratio_vs_nanovllm_tables": round(kv_us / tables_us, 3),
        })
    return result
