"""Logits processing against transformers' own processors on the same logits
(exact in fp32): logit bias (SequenceBiasLogitsProcessor), repetition penalty
(RepetitionPenaltyLogitsProcessor), min_p (MinPLogitsWarper), temperature,
top-k, top-p; presence and frequency penalties (transformers has none)
against a plain per-token loop of OpenAI's formula. Per row in a mixed
batch, and seeds reproducible whatever else shares the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from executor_service.sampler import SamplingInputs, adjust, sample, warp

VOCAB = 64


def _row(**kw) -> dict:
    row = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, bias={}, presence=0.0, frequency=0.0,
               repetition=1.0, prompt=[], output=[], seed=0, num_samples=1, num_top=0)
    row.update(kw)
    return row


def _inputs(rows: list[dict], return_logprobs: bool = False) -> SamplingInputs:
    """SamplingInputs for per-row dicts (an independent builder: not step.py's)."""
    ns = torch.tensor([r["num_samples"] for r in rows])
    inp = SamplingInputs(
        num_samples=ns, temperature=torch.tensor([r["temperature"] for r in rows]),
        top_p=torch.tensor([r["top_p"] for r in rows]), top_k=torch.tensor([r["top_k"] for r in rows]),
        positions=torch.full((len(rows),), 7), seeds=torch.tensor([r["seed"] + j for r in rows
                                                                   for j in range(r["num_samples"])]),
        num_top_logprobs=torch.tensor([r["num_top"] for r in rows]), return_logprobs=return_logprobs,
        min_p=torch.tensor([r["min_p"] for r in rows]))
    bias = [(i, t, v) for i, r in enumerate(rows) for t, v in r["bias"].items()]
    if bias:
        inp.bias_rows = torch.tensor([b[0] for b in bias])
        inp.bias_token_ids = torch.tensor([b[1] for b in bias])
        inp.bias_values = torch.tensor([b[2] for b in bias], dtype=torch.float32)
    pen = [i for i, r in enumerate(rows) if r["presence"] or r["frequency"] or r["repetition"] != 1.0]
    if pen:
        inp.penalty_rows = torch.tensor(pen)
        inp.presence_penalty = torch.tensor([rows[i]["presence"] for i in pen])
        inp.frequency_penalty = torch.tensor([rows[i]["frequency"] for i in pen])
        inp.repetition_penalty = torch.tensor([rows[i]["repetition"] for i in pen])
        hist = [(k, t, j >= len(rows[i]["prompt"])) for k, i in enumerate(pen)
                for j, t in enumerate(rows[i]["prompt"] + rows[i]["output"])]
        inp.history_index = torch.tensor([h[0] for h in hist], dtype=torch.int64)
        inp.history_token_ids = torch.tensor([h[1] for h in hist], dtype=torch.int64)
        inp.history_is_output = torch.tensor([h[2] for h in hist], dtype=torch.bool)
    return inp


def _presence_frequency_reference(scores: np.ndarray, output: list[int], presence: float,
                                  frequency: float) -> np.ndarray:
    """OpenAI's formula, one token at a time, in float32."""
    out = scores.astype(np.float32).copy()
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        out[t] = np.float32(out[t] - np.float32(frequency) * np.float32(c))
        out[t] = np.float32(out[t] - np.float32(presence) * np.float32(1.0))
    return out


def _hf_reference(scores: torch.Tensor, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One row through transformers' processors in the sampler's order:
    (adjusted [V], warped [V])."""
    s = scores[None].clone()
    ids = torch.tensor([row["prompt"] + row["output"]], dtype=torch.int64)
    if row["bias"]:
        s = SequenceBiasLogitsProcessor([[[t], float(v)] for t, v in row["bias"].items()])(ids, s)
    if row["repetition"] != 1.0:
        s = RepetitionPenaltyLogitsProcessor(float(row["repetition"]))(ids, s)
    if row["presence"] or row["frequency"]:
        s = torch.from_numpy(_presence_frequency_reference(s[0].numpy(), row["output"], row["presence"],
                                                           row["frequency"]))[None]
    adjusted = s[0].clone()
    if row["temperature"] <= 0:
        return adjusted, adjusted  # greedy: the argmax of the adjusted logits
    s = TemperatureLogitsWarper(float(row["temperature"]))(ids, s)
    if row["min_p"]:
        s = MinPLogitsWarper(float(row["min_p"]))(ids, s)
    if row["top_k"] > 0:
        s = TopKLogitsWarper(int(row["top_k"]))(ids, s)
    if row["top_p"] < 1.0:
        s = TopPLogitsWarper(float(row["top_p"]))(ids, s)
    return adjusted, s[0]


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _check_rows(rows: list[dict], seed: int = 0) -> None:
    logits = _logits(len(rows), seed)
    inp = _inputs(rows)
    adjusted = adjust(logits, inp)
    warped = warp(adjusted, inp.temperature, inp.min_p, inp.top_k, inp.top_p)
    for i, row in enumerate(rows):
        want_adj, want_warp = _hf_reference(logits[i], row)
        assert torch.equal(adjusted[i], want_adj), (i, row)
        assert torch.equal(warped[i], want_warp), (i, row)


PROMPT, OUTPUT = [3, 5, 5, 9, 11], [9, 20, 20, 20, 31, 3]


def test_logit_bias_is_transformers_sequence_bias():
    _check_rows([_row(bias={4: 5.0, 10: -100.0, 63: 0.25}), _row(), _row(bias={0: -3.5})])


def test_repetition_penalty_is_transformers_over_prompt_and_output():
    _check_rows([_row(repetition=1.3, prompt=PROMPT, output=OUTPUT), _row(repetition=0.7, prompt=PROMPT),
                 _row(prompt=PROMPT, output=OUTPUT)])


def test_presence_and_frequency_penalties_count_the_output_only():
    rows = [_row(presence=0.5, frequency=0.75, prompt=PROMPT, output=OUTPUT),
            _row(presence=-1.0, prompt=PROMPT, output=OUTPUT), _row(frequency=2.0, output=OUTPUT),
            _row(presence=1.5, prompt=PROMPT)]  # a prompt alone is not penalised
    _check_rows(rows)
    logits = _logits(4)
    adjusted = adjust(logits, _inputs(rows))
    assert torch.equal(adjusted[3], logits[3])
    assert adjusted[2, 20] == logits[2, 20] - 6.0 and adjusted[0, 11] == logits[0, 11]  # 11: prompt only


def test_min_p_is_transformers_after_temperature():
    _check_rows([_row(min_p=0.1), _row(min_p=0.5, temperature=0.6), _row(min_p=1.0), _row(temperature=1.7)])


def test_top_k_top_p_are_transformers():
    for seed in range(5):
        _check_rows([_row(top_k=5), _row(top_p=0.9), _row(top_k=20, top_p=0.5, temperature=0.8), _row(top_p=0.3)],
                    seed)


def test_a_mixed_batch_is_every_row_processed_alone():
    rows = [_row(bias={7: 2.0}, repetition=1.2, prompt=PROMPT, output=OUTPUT, min_p=0.05, top_k=30, top_p=0.95),
            _row(temperature=0.5),
            _row(presence=0.3, frequency=0.2, prompt=PROMPT, output=OUTPUT[:2], top_p=0.8),
            _row(bias={1: -1.0, 2: 1.0}, min_p=0.2, temperature=1.3),
            _row(repetition=1.1, presence=-0.5, output=OUTPUT, top_k=10)]
    _check_rows(rows, seed=3)
    logits = _logits(len(rows), 3)
    together = warp(adjust(logits, _inputs(rows)), *(_inputs(rows).__getattribute__(k)
                                                    for k in ("temperature", "min_p", "top_k", "top_p")))
    for i, row in enumerate(rows):
        alone_in = _inputs([row])
        alone = warp(adjust(logits[i:i + 1], alone_in), alone_in.temperature, alone_in.min_p, alone_in.top_k,
                     alone_in.top_p)
        assert torch.equal(together[i], alone[0])


def test_greedy_takes_the_argmax_after_bias_and_penalties():
    logits = _logits(3, 5)
    top = int(logits[0].argmax())
    rows = [_row(temperature=0.0, bias={top: -100.0}), _row(temperature=0.0, repetition=50.0, prompt=[int(
        logits[1].argmax())]), _row(temperature=0.0)]
    out = sample(logits, _inputs(rows))
    assert out.token_ids[0] != top and out.token_ids[1] != logits[1].argmax()
    assert out.token_ids[2] == logits[2].argmax()
    for i, row in enumerate(rows):
        assert out.token_ids[i] == _hf_reference(logits[i], row)[0].argmax()


def test_seeded_penalised_rows_sample_the_same_alone_or_in_any_batch():
    logits = _logits(4, 9)
    rows = [_row(seed=11, repetition=1.4, presence=0.4, prompt=PROMPT, output=OUTPUT, bias={3: 1.0}, min_p=0.02),
            _row(seed=22, temperature=0.7, frequency=0.9, output=OUTPUT),
            _row(seed=33, num_samples=3, top_k=12),
            _row(seed=44, temperature=0.0, repetition=1.2, prompt=PROMPT)]
    together = sample(logits, _inputs(rows)).token_ids.tolist()
    alone = [sample(logits[i:i + 1], _inputs([r])).token_ids.tolist() for i, r in enumerate(rows)]
    assert together == [t for a in alone for t in a]
    order = [2, 0, 3, 1]
    shuffled = sample(logits[order], _inputs([rows[i] for i in order])).token_ids.tolist()
    assert shuffled == [t for i in order for t in alone[i]]


def test_sampled_rows_return_top_logprobs_of_the_raw_logits():
    logits = _logits(2, 4)
    rows = [_row(num_top=5, bias={0: 50.0}, seed=1), _row(num_samples=2, num_top=3, temperature=0.0)]
    out = sample(logits, _inputs(rows, return_logprobs=True))
    raw = logits.log_softmax(-1)
    assert out.token_ids[0] == 0  # the bias decides the draw ...
    assert torch.allclose(out.logprobs[0], raw[0, 0])  # ... the logprob stays the raw model's
    assert out.top_counts.tolist() == [5, 3]
    want_ids = torch.cat([raw[0].topk(5).indices, raw[1].topk(3).indices])
    assert torch.equal(out.top_token_ids, want_ids)
    assert torch.equal(out.top_logprobs, torch.cat([raw[0].topk(5).values, raw[1].topk(3).values]))


def test_penalties_change_only_the_entries_a_history_names():
    """The penalties touch (row, token) entries named by a row's history and
    nothing else, also on strided logits and with repeated tokens."""
    from executor_service.sampler import apply_penalties

    g = torch.Generator().manual_seed(5)
    wide = torch.randn(3, 80, generator=g)
    logits = wide[:, 10:60]  # strided rows
    inp = SamplingInputs(
        num_samples=torch.ones(3, dtype=torch.int64), temperature=torch.zeros(3), top_p=torch.ones(3),
        top_k=torch.zeros(3, dtype=torch.int64), positions=torch.zeros(3, dtype=torch.int64),
        seeds=torch.zeros(3, dtype=torch.int64), num_top_logprobs=torch.zeros(3, dtype=torch.int64),
        penalty_rows=torch.tensor([0, 2]), presence_penalty=torch.tensor([0.5, -1.0]),
        frequency_penalty=torch.tensor([0.25, 2.0]), repetition_penalty=torch.tensor([1.3, 0.8]),
        history_index=torch.tensor([0, 0, 0, 1, 1]), history_token_ids=torch.tensor([4, 4, 9, 4, 49]),
        history_is_output=torch.tensor([True, True, False, True, False]))
    out = apply_penalties(logits, inp)
    changed = (out != logits).nonzero().tolist()
    assert sorted(map(tuple, changed)) == [(0, 4), (0, 9), (2, 4), (2, 49)]

    def want(x, rep, freq, pres, count):
        x = x * rep if x < 0 else x / rep
        return x - freq * count - pres * (count > 0)

    for (r, t), (rep, freq, pres, count) in {(0, 4): (1.3, 0.25, 0.5, 2), (0, 9): (1.3, 0.25, 0.5, 0),
                                              (2, 4): (0.8, 2.0, -1.0, 1), (2, 49): (0.8, 2.0, -1.0, 0)}.items():
        assert out[r, t].item() == pytest.approx(want(logits[r, t].item(), rep, freq, pres, count), rel=1e-6)
