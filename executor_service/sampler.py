"""Token sampling: greedy, temperature, penalties, logit bias, min-p, top-k,
top-p, reproducible seeds.

Randomness never comes from a global RNG or from a row's place in the batch.
Each sampled token draws from a counter-based hash of
``(seed, position, token_id)`` (splitmix64; kvpager_kernels.gumbel), so
the same request samples the same tokens whatever else shares its batch, in
any order, across process restarts and machines. ``position`` is the
absolute position the sampled token will occupy (context_len + query_len of
its sequence). Every sampled token carries its own seed: n>1 parallel
samples drawn from the same logits differ because the gateway gives
completion i the seed ``seed + i`` — and so completion i equals what a
request with that seed alone would produce.

The draw is an exponential race (the Gumbel-max trick): the token maximising
``log p_t - log(-log u_t)`` is an exact sample of ``p`` after the logits
processing below (on CPU one pass of a C++ kernel, ``gumbel_argmax``).

Processing, in vLLM's order (each step the same float32 arithmetic as
transformers' own processor, so the result is exact against it):

1. ``adjust`` (every row, greedy ones too): logit bias (added), then the
   penalties: repetition over the prompt's and the generated tokens
   (``RepetitionPenaltyLogitsProcessor``: positive logits divided, negative
   ones multiplied), frequency and presence over the generated ones
   (OpenAI's ``l - f * count - p * (count > 0)``);
2. ``warp`` (rows that sample): temperature, min_p (``MinPLogitsWarper``),
   top-k, top-p.

A neutral value (bias 0, penalty 1 or 0, min_p 0) leaves a row bit-for-bit
unchanged, so rows with and without each parameter share one vectorised pass.
The token histories penalties count arrive as flat (row, token) pairs; the
sampler is a pure function of (logits, inputs).

Logprobs are always taken from ``log_softmax`` of the RAW logits (before
bias, penalties, temperature and filtering: vLLM's default "raw" logprobs),
both for the sampled token and for the top alternatives (beam search,
``top_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpager_kernels.greedy import argmax_rows
from kvpager_kernels.gumbel import gumbel_argmax, row_keys
from kvpager_kernels.sort_rows import sort_rows


@dataclass(slots=True)
class SamplingInputs:
    """Per logits row (one per sequence that samples or wants top logprobs)."""

    num_samples: torch.Tensor       # [R] int64
    temperature: torch.Tensor       # [R] float32; 0 = greedy
    top_p: torch.Tensor             # [R] float32 in (0, 1]
    top_k: torch.Tensor             # [R] int64; <= 0 disabled
    positions: torch.Tensor         # [R] int64: position of the sampled token
    seeds: torch.Tensor             # [sum(num_samples)] int64
    num_top_logprobs: torch.Tensor  # [R] int64
    return_logprobs: bool = False
    min_p: torch.Tensor | None = None               # [R] float32 in [0, 1]; None: off for every row
    # logit bias, one entry per (row, token): [B] int64, int64, float32
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # penalties, for the rows penalty_rows [P] (int64 logits rows) only
    penalty_rows: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None    # [P] float32
    frequency_penalty: torch.Tensor | None = None   # [P] float32
    repetition_penalty: torch.Tensor | None = None  # [P] float32 > 0
    # each penalised row's tokens (prompt + generated), flat: [H] int64 index into
    # penalty_rows, [H] int64 token id, [H] bool (generated, not prompt)
    history_index: torch.Tensor | None = None
    history_token_ids: torch.Tensor | None = None
    history_is_output: torch.Tensor | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor            # [N] int64, N = sum(num_samples)
    logprobs: torch.Tensor | None      # [N] float32 when asked
    top_counts: torch.Tensor           # [R] int64: top logprobs per row
    top_token_ids: torch.Tensor        # [sum(top_counts)] int64
    top_logprobs: torch.Tensor         # [sum(top_counts)] float32


def filters(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> bool:
    """Whether some row's top-k or top-p drops tokens (top_k, top_p: [N])."""
    return bool(((top_k > 0) & (top_k < vocab)).any()) or bool((top_p < 1.0).any())


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p.

    logits: [N, V] (temperature already applied); top_k: [N] (<= 0 or >= V
    disabled; ties with the k-th value are kept); top_p: [N] in (0, 1]: keeps
    the smallest prefix of tokens, by descending probability, whose mass
    reaches top_p (the most likely token is always kept).
    """
    if not filters(top_k, top_p, logits.shape[-1]):
        return logits
    sorted_logits, sorted_idx = top_k_top_p_sorted(logits, top_k, top_p)
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_top_k_top_p`` left in each row's descending order: (values
    [N, V] with the dropped tokens -inf, all after the kept ones; token ids
    [N, V])."""
    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    sorted_logits, sorted_idx = sort_rows(logits)  # [N, V] descending, ties in token order
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, torch.full_like(top_k, vocab)).clamp(1, vocab)
        kth = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if bool(use_p.any()):
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [N, V]
        # Rows without top-p drop nothing: their mass can round past 1.0 before the tail.
        drop = (mass_before >= top_p[:, None]) & use_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits, sorted_idx


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """logits [R, V] + bias at (rows[i], token_ids[i]) [B] (distinct pairs)."""
    out = logits.clone()
    out.index_put_((rows, token_ids), values.to(out.dtype), accumulate=True)
    return out


def apply_penalties(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """Repetition, then frequency and presence penalties on ``inputs.penalty_rows`` of logits [R, V].

    Only the (row, token) entries a history names change (an entry no token
    of it names keeps its value: divided by nothing, minus zero), so the
    work is over the histories' tokens, not [P, V] (``sample`` for 32
    greedy rows x 32,000 with 300-token histories: 4.4 -> 0.7 ms). Each
    entry's arithmetic is transformers' processors' (tests)."""
    vocab = logits.shape[-1]
    index, tokens, is_out = inputs.history_index, inputs.history_token_ids, inputs.history_is_output  # [H]
    flat_at = inputs.penalty_rows[index] * vocab + tokens  # [H]: each history token's entry of logits
    entries, which = torch.unique(flat_at, return_inverse=True)  # [E] entries named, each token's among them
    counts = torch.zeros(len(entries), dtype=logits.dtype, device=logits.device)
    counts.index_add_(0, which[is_out], torch.ones_like(which[is_out], dtype=logits.dtype))  # generated only
    penalty_row = torch.empty_like(entries).scatter_(0, which, index)  # [E]: the entry's row among penalty_rows
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    vals = flat[entries]  # seen in the prompt or the output: repetition applies
    rep = inputs.repetition_penalty[penalty_row].to(vals.dtype)
    vals = torch.where(vals < 0, vals * rep, vals / rep)
    vals = vals - inputs.frequency_penalty[penalty_row].to(vals.dtype) * counts
    vals = vals - inputs.presence_penalty[penalty_row].to(vals.dtype) * (counts > 0).to(vals.dtype)
    flat[entries] = vals
    return out


def adjust(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """Logit bias and penalties on the raw logits [R, V] (what greedy rows take
    the argmax of), in float32; where neither applies, the logits as they came
    (a 16-bit row's argmax is its float32 copy's: no copy made)."""
    if inputs.bias_rows is not None and inputs.bias_rows.numel():
        logits = apply_logit_bias(logits.float(), inputs.bias_rows, inputs.bias_token_ids, inputs.bias_values)
    if inputs.penalty_rows is not None and inputs.penalty_rows.numel():
        logits = apply_penalties(logits.float(), inputs)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p [N] x the row's top probability
    (logits [N, V], temperature applied; min_p 0 masks nothing)."""
    probs = logits.softmax(dim=-1)
    remove = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)  # the top token always stays
    return logits.masked_fill(remove, float("-inf"))


def scale(adjusted: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """adjusted [N, V] / temperature [N] (> 0), then min_p filtering."""
    scaled = adjusted / temperature[:, None]
    if min_p is not None and bool((min_p > 0).any()):
        scaled = apply_min_p(scaled, min_p)
    return scaled


def warp(adjusted: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None, top_k: torch.Tensor,
         top_p: torch.Tensor) -> torch.Tensor:
    """The logits a sampled token is drawn from: adjusted [N, V] / temperature [N] (> 0),
    then min_p, top-k and top-p filtering (each [N])."""
    return apply_top_k_top_p(scale(adjusted, temperature, min_p), top_k, top_p)


def sample(logits: torch.Tensor, inputs: SamplingInputs) -> SamplerOutput:
    """Draw ``num_samples[r]`` tokens from row r of ``logits`` [R, V]."""
    num_rows, vocab = logits.shape
    device = logits.device
    rows = torch.arange(num_rows, device=device)
    one_each = bool((inputs.num_samples == 1).all())  # a decode step's rows (no fan-out, no beam candidates)
    sample_row = rows if one_each else torch.repeat_interleave(rows, inputs.num_samples)  # [N]
    adjusted = adjust(logits, inputs)  # [R, V]

    temperature = inputs.temperature if one_each else inputs.temperature[sample_row]
    greedy = temperature <= 0
    # The first of tied maxima, NaN as the maximum (max(dim=-1).indices; on CPU
    # a kernel: 0.46 -> 0.07 ms for 32 x 32,000, kvpager_kernels.greedy).
    if one_each and bool(greedy.all()):  # one greedy sample a row: no gather
        token_ids = argmax_rows(adjusted)
    else:
        token_ids = torch.empty(sample_row.numel(), dtype=torch.int64, device=device)
        if bool(greedy.any()):
            token_ids[greedy] = argmax_rows(adjusted[sample_row[greedy]])
        rand = ~greedy
        if bool(rand.any()):
            r = sample_row[rand]
            scaled = scale(adjusted[r].float(), temperature[rand],
                           inputs.min_p[r] if inputs.min_p is not None else None)  # [Nr, V]
            # keyed by (seed, position) only: completion i of n equals seed + i alone
            keys = row_keys(inputs.seeds[rand], inputs.positions[r], torch.zeros_like(r))  # [Nr]
            top_k, top_p = inputs.top_k[r], inputs.top_p[r]
            if filters(top_k, top_p, vocab):  # drawn in each row's sorted order, from its kept tokens only
                kept, order = top_k_top_p_sorted(scaled, top_k, top_p)
                token_ids[rand] = gumbel_argmax(kept.log_softmax(dim=-1), keys, order)
            else:
                token_ids[rand] = gumbel_argmax(scaled.log_softmax(dim=-1), keys)

    need_raw = inputs.return_logprobs or bool((inputs.num_top_logprobs > 0).any())
    raw = logits.float().log_softmax(dim=-1) if need_raw else None
    logprobs = raw[sample_row, token_ids] if inputs.return_logprobs else None

    top_counts = inputs.num_top_logprobs.clamp(0, vocab)
    max_top = int(top_counts.max()) if num_rows else 0
    if max_top > 0:
        top_vals, top_ids = raw.topk(max_top, dim=-1)  # [R, K], sorted descending
        keep = torch.arange(max_top, device=device)[None, :] < top_counts[:, None]
        top_token_ids, top_logprobs = top_ids[keep], top_vals[keep]
    else:
        top_token_ids = torch.empty(0, dtype=torch.int64, device=device)
        top_logprobs = torch.empty(0, dtype=torch.float32, device=device)
    return SamplerOutput(token_ids, logprobs, top_counts, top_token_ids, top_logprobs)
