"""Beam search on the memory service's fork and free.

Beams are sequences that share blocks: a beam kept with two continuations
forks (children share every block; the first write into the shared partial
block copies exactly that block), a pruned beam is freed and releases only
what no other beam holds. Each step every running beam computes its last
token and the executor returns its top log-probabilities; the selection
below then reproduces `transformers`' beam search (v5 `_beam_search`:
top-K continuations over all beams, K = max(2, 1 + #eos) * beams; finished
hypotheses scored with `length_penalty`; the early-stop heuristic with
`early_stopping=False`), so greedy beam outputs are token-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gateway.outputs import take_output
from gateway.state import Completion, Finish, Output, Request, Seq

_NEG = -1.0e9


@dataclass(slots=True, eq=False)
class Beam:
    seq: Seq
    score: float            # accumulated log-probability
    generated: list[int]    # tokens generated so far


@dataclass(slots=True, eq=False)
class BeamState:
    num_beams: int
    beams_to_keep: int
    prompt_len: int
    max_length: int          # prompt + max_tokens
    running: list[Beam] = field(default_factory=list)
    # finished hypotheses: (score, tokens), at most num_beams, best first
    finished: list[tuple[float, list[int]]] = field(default_factory=list)
    heuristic_unsatisfied: bool = True
    # candidates gathered this step: seq_id -> [(token, logprob)]
    pending: dict[int, list[tuple[int, float]]] = field(default_factory=dict)

    def forget(self, seq_ids: list[int]) -> None:
        """Drop the candidates gathered under ``seq_ids``: their beams were
        rewound (gateway/recovery.py) and compute them again under new ids."""
        for seq_id in seq_ids:
            self.pending.pop(seq_id, None)


class SequenceOps(Protocol):
    """What beam search (and parallel sampling) may do with sequences: the
    engine's narrow interface, so the search never touches engine state."""

    eos_ids: frozenset[int]

    def fork(self, parent: Seq, completions: list[Completion | None]) -> list[Seq]:
        """Children sharing parent's blocks (copy-on-write), one per completion."""

    def append(self, seq: Seq, token: int) -> None:
        """A token joins the sequence (sent to the memory service with the next Step)."""

    def free(self, seq: Seq) -> None:
        """The sequence is done; its blocks go back (shared ones stay with the other holders)."""

    def emit(self, req: Request, out: Output) -> None:
        """Stream an output of the request."""

    def finish(self, req: Request) -> None:
        """Every completion of the request is final: end its stream."""

    def fail_on_bug(self, req: Request, doing: str) -> None:
        """End the request with INTERNAL after an unexpected exception."""


class BeamSearch:
    """Per-request beam state, driven by the engine through ``SequenceOps``."""

    def __init__(self, ops: SequenceOps) -> None:
        self.ops = ops
        self._touched: list[Request] = []

    def start(self, req: Request, seq: Seq) -> None:
        spec = req.spec
        keep = max(2, 1 + len(self.ops.eos_ids)) * spec.beam_width
        state = BeamState(spec.beam_width, keep, len(req.prompt_ids), len(req.prompt_ids) + spec.max_tokens)
        state.running = [Beam(seq, 0.0, [])]
        req.beam = state

    def top_k(self, req: Request) -> int:
        return req.beam.beams_to_keep

    def candidates(self, seq: Seq, token_ids: list[int], logprobs: list[float]) -> None:
        req = seq.request
        state: BeamState = req.beam
        if state is None or req.done:
            return
        state.pending[seq.seq_id] = list(zip(token_ids, logprobs))
        if req not in self._touched:
            self._touched.append(req)

    def finish_step(self) -> None:
        touched, self._touched = self._touched, []
        for req in touched:
            state: BeamState = req.beam
            if req.done or len(state.pending) < len(state.running):
                continue  # not every beam computed this step (preempted): wait for the rest
            try:
                self._advance(req, state)
            except Exception:  # one search's bug must not end the other requests
                self.ops.fail_on_bug(req, "advancing its beam search")

    def _advance(self, req: Request, state: BeamState) -> None:
        eos = self.ops.eos_ids if not req.spec.ignore_eos else frozenset()
        lp_pen = req.spec.length_penalty
        cur_len = state.prompt_len + len(state.running[0].generated)
        # top-K continuations over all beams, by accumulated log-probability
        cands = []
        for b_idx, beam in enumerate(state.running):
            for token, lp in state.pending.pop(beam.seq.seq_id):
                cands.append((beam.score + lp, -b_idx, -token, b_idx, token))
        cands.sort(reverse=True)  # ties: lower beam index, then lower token id (flattened topk order)
        top = cands[: state.beams_to_keep]
        last_step = cur_len + 1 >= state.max_length
        hits = [last_step or c[4] in eos for c in top]
        # finished hypotheses: only among the top num_beams candidates
        new_finished = list(state.finished)
        gen_len = cur_len + 1 - state.prompt_len
        for rank, (c, hit) in enumerate(zip(top, hits)):
            if rank >= state.num_beams or not hit or not state.heuristic_unsatisfied:
                continue
            beam = state.running[c[3]]
            new_finished.append((c[0] / (gen_len ** lp_pen), beam.generated + [c[4]]))
        new_finished.sort(key=lambda f: f[0], reverse=True)
        state.finished = new_finished[: state.num_beams]
        # next running beams: best non-finished continuations
        ranked = sorted(((c[0] + (_NEG if hit else 0.0), i) for i, (c, hit) in enumerate(zip(top, hits))),
                        key=lambda x: (-x[0], x[1]))[: state.num_beams]
        chosen = [(score, top[i]) for score, i in ranked]
        # early-stop heuristic (early_stopping=False): best running at the current length vs worst finished
        if chosen:
            best_possible = chosen[0][0] / (gen_len ** lp_pen)
            full = len(state.finished) == state.num_beams
            worst = min(f[0] for f in state.finished) if full else _NEG
            state.heuristic_unsatisfied = state.heuristic_unsatisfied and (not full or best_possible > worst)
        done = not state.heuristic_unsatisfied or all(hits) or not chosen
        if done:
            self._complete(req, state)
            return
        self._reshape(req, state, chosen)

    def _reshape(self, req: Request, state: BeamState, chosen: list) -> None:
        """New running beams from their parents: the first child of a parent
        continues in the parent's sequence, the others fork it, parents with
        no child are freed."""
        ops = self.ops
        firsts: dict[int, int] = {}           # parent beam index -> rank of the child that continues it
        extra: dict[int, list[int]] = {}      # parent beam index -> ranks of the children that fork it
        for rank, (_, c) in enumerate(chosen):  # HF's order: best first
            if c[3] not in firsts:
                firsts[c[3]] = rank
            else:
                extra.setdefault(c[3], []).append(rank)
        seqs: dict[int, Seq] = {rank: state.running[b].seq for b, rank in firsts.items()}
        for b, ranks in extra.items():
            for rank, child in zip(ranks, ops.fork(state.running[b].seq, [None] * len(ranks))):
                seqs[rank] = child
        for b_idx, beam in enumerate(state.running):
            if b_idx not in firsts:
                ops.free(beam.seq)
        new_running = [Beam(seqs[rank], score, state.running[c[3]].generated + [c[4]])
                       for rank, (score, c) in enumerate(chosen)]
        state.running = new_running
        for beam in new_running:
            ops.append(beam.seq, beam.generated[-1])

    def _complete(self, req: Request, state: BeamState) -> None:
        ops = self.ops
        for beam in state.running:
            ops.free(beam.seq)
        state.running = []
        eos = ops.eos_ids
        req.completions = req.completions[: req.spec.n]
        for comp, (score, tokens) in zip(req.completions, state.finished):
            comp.output_ids = list(tokens)
            comp.detok.add([t for t in tokens if t not in eos])
            comp.cumulative_logprob = score
            comp.finish = Finish.STOP if tokens and tokens[-1] in eos else Finish.LENGTH
            out = take_output(req, comp)
            if out is not None:
                ops.emit(req, out)
        ops.finish(req)
