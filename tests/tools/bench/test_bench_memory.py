"""Smoke runs of `kvpager bench memory`'s decode-step comparison on a tiny
workload: its keys, the phase split against MemoryManager.step, and the
nano-vllm loader (on a stand-in tree written here; on a real checkout when
KVPAGER_NANOVLLM_DIR names one). Never timed: the figures live in
docs/benchmarks.md."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from kvpager_tools.bench import decode_step as ds

TINY = ds.DecodeWorkload(batch=8, prompt_lo=5, prompt_hi=40, block_size=4, steps=12, runs=2)

# A stand-in with nano-vllm's block-manager interface (not its code): the
# calls NanoDecode makes, and the package import the real modules make.
_SEQUENCE = '''
from nanovllm.sampling_params import SamplingParams


class Sequence:
    block_size = 256

    def __init__(self, token_ids, sampling_params=SamplingParams()):
        self.token_ids = list(token_ids)
        self.num_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.is_prefill = True
        self.block_table = []

    def __len__(self):
        return self.num_tokens

    @property
    def last_block_num_tokens(self):
        return self.num_tokens - (len(self.block_table) - 1) * self.block_size

    def append_token(self, token_id):
        self.token_ids.append(token_id)
        self.num_tokens += 1
'''
_BLOCK_MANAGER = '''
from nanovllm.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.hashes = {}

    def can_allocate(self, seq):
        return 0 if len(self.free) * self.block_size >= len(seq) else -1

    def allocate(self, seq, num_cached_blocks):
        while len(seq.block_table) * self.block_size < len(seq):
            seq.block_table.append(self.free.pop())

    def can_append(self, seq):
        return bool(self.free) or len(seq) % self.block_size != 1

    def may_append(self, seq):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self.free.pop())

    def hash_blocks(self, seq):
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        for i in range(seq.num_cached_tokens // self.block_size, end):
            self.hashes[tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])] = seq.block_table[i]
'''


@pytest.fixture
def standin(tmp_path):
    engine = tmp_path / "nanovllm" / "engine"
    engine.mkdir(parents=True)
    (engine / "sequence.py").write_text(textwrap.dedent(_SEQUENCE))
    (engine / "block_manager.py").write_text(textwrap.dedent(_BLOCK_MANAGER))
    return tmp_path


def test_split_step_is_the_step():
    """The timed phases make the same calls as MemoryManager.step: same plans, same state."""
    prompts, sampled = TINY.prompts(0), TINY.sampled(0)
    whole, split = ds.KvpagerDecode(TINY, prompts, sampled), ds.KvpagerDecode(TINY, prompts, sampled)
    for i in range(TINY.steps):
        a = whole.step(i)
        b, parts = ds.split_step(split.m, split.requests[i])
        assert len(parts) == len(ds.PHASES) and all(t >= 0 for t in parts)
        assert [(p.executor_id, list(p.seq_ids), list(p.query_lens), p.tables, p.ops) for p in a.executor_plans] == \
               [(p.executor_id, list(p.seq_ids), list(p.query_lens), p.tables, p.ops) for p in b.executor_plans]
    assert {s: (s_.num_computed, list(s_.block_ids)) for s, s_ in whole.m.seqs.items()} == \
           {s: (s_.num_computed, list(s_.block_ids)) for s, s_ in split.m.seqs.items()}
    assert whole.m.check_invariants() == [] and split.m.check_invariants() == []


def test_measure_without_nanovllm():
    r = ds.measure(TINY)
    assert r["decode_workload"]["batch"] == 8
    assert r["decode_step_us"] > 0 and len(r["decode_step_us_runs"]) == TINY.runs
    assert set(r["decode_split_us"]) == set(ds.PHASES)
    assert "ratio_vs_nanovllm" not in r


def test_measure_with_standin(standin):
    before = {k for k in sys.modules if k.startswith("nanovllm")}
    r = ds.measure(TINY, str(standin))
    assert {k for k in sys.modules if k.startswith("nanovllm")} == before  # the stand-in modules are gone
    for key in ("nanovllm_step_us", "nanovllm_tables_step_us", "ratio_vs_nanovllm", "ratio_vs_nanovllm_tables"):
        assert r[key] > 0, key
    assert len(r["ratio_vs_nanovllm_runs"]) == TINY.runs


def test_nanovllm_tables_step(standin):
    classes = ds.load_nanovllm(standin)
    prompts, sampled = TINY.prompts(0), TINY.sampled(0)
    nano = ds.NanoDecode(classes, TINY, prompts, sampled, tables=True)
    slots, context_lens, tables = nano.step(0)
    assert context_lens == [len(p) + 1 for p in prompts]
    assert len({len(t) for t in tables}) == 1  # padded to the longest
    bs = TINY.block_size
    assert slots == [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, context_lens)]


def test_not_a_checkout(tmp_path):
    with pytest.raises(FileNotFoundError):
        ds.load_nanovllm(tmp_path)


@pytest.mark.skipif(not os.environ.get("KVPAGER_NANOVLLM_DIR"), reason="KVPAGER_NANOVLLM_DIR names no checkout")
def test_measure_real_nanovllm():
    pytest.importorskip("xxhash")
    r = ds.measure(TINY, os.environ["KVPAGER_NANOVLLM_DIR"])
    assert r["nanovllm_step_us"] > 0 and r["ratio_vs_nanovllm"] > 0
