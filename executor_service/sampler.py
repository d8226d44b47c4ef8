"""Token sampling: greedy, temperature, top-k, top-p, reproducible seeds.

Randomness never comes from a global RNG or from a row's place in the batch.
Each sampled token draws from a counter-based hash of
``(seed, position, token_id)`` (splitmix64, vectorised in torch int64), so
the same request samples the same tokens whatever else shares its batch, in
any order, across process restarts and machines. ``position`` is the
absolute position the sampled token will occupy (context_len + query_len of
its sequence). Every sampled token carries its own seed: n>1 parallel
samples drawn from the same logits differ because the gateway gives
completion i the seed ``seed + i`` — and so completion i equals what a
request with that seed alone would produce.

The draw is an exponential race (the Gumbel-max trick): the token maximising
``log p_t - log(-log u_t)`` is an exact sample of ``p`` after temperature,
top-k and top-p filtering.

Logprobs are always taken from ``log_softmax`` of the RAW logits (before
temperature and filtering), both for the sampled token and for the top-k
alternatives returned for beam search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser over int64 tensors (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def hash_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, sample_index: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Uniforms in (0, 1), one per (sample, token id).

    seeds, positions, sample_index: [N] int64 -> [N, vocab_size] float64.
    """
    h = splitmix64(splitmix64(splitmix64(seeds) ^ positions) ^ sample_index)  # [N]
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    bits = splitmix64(h[:, None] ^ token_ids[None, :])  # [N, V]
    return (_shr(bits, 11).to(torch.float64) + 0.5) * (2.0**-53)


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


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor            # [N] int64, N = sum(num_samples)
    logprobs: torch.Tensor | None      # [N] float32 when asked
    top_counts: torch.Tensor           # [R] int64: top logprobs per row
    top_token_ids: torch.Tensor        # [sum(top_counts)] int64
    top_logprobs: torch.Tensor         # [sum(top_counts)] float32


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p.

    logits: [N, V] (temperature already applied); top_k: [N] (<= 0 or >= V
    disabled; ties with the k-th value are kept); top_p: [N] in (0, 1]: keeps
    the smallest prefix of tokens, by descending probability, whose mass
    reaches top_p (the most likely token is always kept).
    """
    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if not bool(use_k.any()) and not bool(use_p.any()):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [N, V]
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, torch.full_like(top_k, vocab)).clamp(1, vocab)
        kth = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if bool(use_p.any()):
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [N, V]
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, inputs: SamplingInputs) -> SamplerOutput:
    """Draw ``num_samples[r]`` tokens from row r of ``logits`` [R, V]."""
    logits = logits.float()
    num_rows, vocab = logits.shape
    device = logits.device
    rows = torch.arange(num_rows, device=device)
    sample_row = torch.repeat_interleave(rows, inputs.num_samples)  # [N]
    num_total = sample_row.numel()
    first = torch.cumsum(inputs.num_samples, 0) - inputs.num_samples  # [R]
    sample_index = torch.arange(num_total, device=device) - first[sample_row]  # [N]

    token_ids = torch.empty(num_total, dtype=torch.int64, device=device)
    temperature = inputs.temperature[sample_row]
    greedy = temperature <= 0
    if bool(greedy.any()):
        token_ids[greedy] = logits[sample_row[greedy]].argmax(dim=-1)
    rand = ~greedy
    if bool(rand.any()):
        r = sample_row[rand]
        scaled = logits[r] / temperature[rand][:, None]  # [Nr, V]
        scaled = apply_top_k_top_p(scaled, inputs.top_k[r], inputs.top_p[r])
        log_p = scaled.log_softmax(dim=-1)
        # keyed by (seed, position) only: completion i of n equals seed + i alone
        u = hash_uniform(inputs.seeds[rand], inputs.positions[r], torch.zeros_like(sample_index[rand]), vocab)
        gumbel = -torch.log(-torch.log(u))  # [Nr, V] float64
        token_ids[rand] = (log_p.double() + gumbel).argmax(dim=-1)

    need_raw = inputs.return_logprobs or bool((inputs.num_top_logprobs > 0).any())
    raw = logits.log_softmax(dim=-1) if need_raw else None
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
