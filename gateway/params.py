"""Request validation: everything is checked before anything is allocated.

Plain values in, a typed `SamplingSpec` out, or a domain error with a
message a client can act on. No grpc here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpager.errors import InvalidArgument

MAX_LENGTH_PENALTY = 10.0


@dataclass(slots=True, frozen=True)
class Limits:
    max_model_len: int          # context limit (tokens)
    vocab_size: int
    max_n: int = 8
    max_prompt_tokens: int = 0  # 0 = max_model_len - 1


@dataclass(slots=True, frozen=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: bool = False

    @property
    def num_completions(self) -> int:
        return self.beam_width if self.beam_width > 1 else self.n


@dataclass(slots=True)
class RawParams:
    """Sampling fields as they arrive (proto3 zeros mean "unset" where noted)."""

    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0          # 0 = unset -> 1
    top_k: int = 0              # 0 or -1 = disabled
    seed: int | None = None
    n: int = 0                  # 0 = unset -> 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    beam_width: int = 0
    length_penalty: float = 0.0  # 0 = unset -> 1
    min_tokens: int = 0
    logprobs: int = 0


def validate(raw: RawParams, prompt_len: int, limits: Limits) -> SamplingSpec:
    if prompt_len == 0:
        raise InvalidArgument("prompt is empty")
    max_prompt = limits.max_prompt_tokens or limits.max_model_len - 1
    if prompt_len >= limits.max_model_len or prompt_len > max_prompt:
        raise InvalidArgument(f"prompt has {prompt_len} tokens; the limit is {min(max_prompt, limits.max_model_len - 1)}")
    if raw.max_tokens < 1:
        raise InvalidArgument("max_tokens must be >= 1")
    if prompt_len + raw.max_tokens > limits.max_model_len:
        raise InvalidArgument(f"prompt ({prompt_len} tokens) + max_tokens ({raw.max_tokens}) exceeds the context "
                              f"limit of {limits.max_model_len}")
    if not math.isfinite(raw.temperature) or raw.temperature < 0:
        raise InvalidArgument(f"temperature must be finite and >= 0, got {raw.temperature}")
    top_p = raw.top_p or 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1], got {raw.top_p}")
    if raw.top_k < -1:
        raise InvalidArgument(f"top_k must be -1 (disabled) or >= 0, got {raw.top_k}")
    n = raw.n or 1
    if n < 1 or n > limits.max_n:
        raise InvalidArgument(f"n must be in [1, {limits.max_n}], got {raw.n}")
    beam = raw.beam_width or 1
    if beam > limits.max_n:
        raise InvalidArgument(f"beam_width must be <= {limits.max_n}, got {raw.beam_width}")
    if beam > 1 and raw.temperature != 0:
        raise InvalidArgument("beam search is deterministic: use temperature 0 with beam_width > 1")
    if beam > 1 and n > beam:
        raise InvalidArgument(f"n ({n}) cannot exceed beam_width ({beam})")
    length_penalty = raw.length_penalty or 1.0
    # Bounded: len ** penalty must stay a normal float (a penalty of -1e10
    # underflowed to 0 and the beam score divided by it).
    if not math.isfinite(length_penalty) or abs(length_penalty) > MAX_LENGTH_PENALTY:
        raise InvalidArgument(f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                              f"got {raw.length_penalty}")
    for s in raw.stop:
        if s == "":
            raise InvalidArgument("stop strings must not be empty")
    for t in raw.stop_token_ids:
        if not 0 <= t < limits.vocab_size:
            raise InvalidArgument(f"stop token id {t} is outside the vocabulary (size {limits.vocab_size})")
    if raw.min_tokens > raw.max_tokens:
        raise InvalidArgument("min_tokens must be <= max_tokens")
    return SamplingSpec(max_tokens=raw.max_tokens, temperature=float(raw.temperature), top_p=float(top_p),
                        top_k=-1 if raw.top_k in (0, -1) else raw.top_k, seed=raw.seed, n=n,
                        stop=tuple(raw.stop), stop_token_ids=tuple(raw.stop_token_ids), ignore_eos=raw.ignore_eos,
                        beam_width=beam, length_penalty=float(length_penalty), min_tokens=raw.min_tokens,
                        logprobs=raw.logprobs > 0)


def validate_token_ids(token_ids: list[int], vocab_size: int) -> None:
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"prompt token id {t} is outside the vocabulary (size {vocab_size})")
