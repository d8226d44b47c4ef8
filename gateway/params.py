"""Request validation: everything is checked before anything is allocated.

Plain values in, a typed `SamplingSpec` out, or a domain error with a
message a client can act on (and the field at fault, ``param``). Both
client APIs (gRPC and the OpenAI-compatible HTTP one) validate here, so
they accept the same requests with the same messages. No grpc here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpager.errors import InvalidArgument

MAX_LENGTH_PENALTY = 10.0
MAX_TOP_LOGPROBS = 20       # as vLLM's default max_logprobs and OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300        # entries per request (each is re-sent with every step the request samples in)
MAX_ABS_PENALTY = 2.0       # presence / frequency, OpenAI's range
MAX_ABS_BIAS = 100.0


@dataclass(slots=True, frozen=True)
class RequestCaps:
    """What one request may ask of the gateway, checked before the work it
    would cause (docs/security.md, "Limits"; each is a gateway flag).
    Stop strings are matched at every sampled token and stop token ids
    looked up at every one: both are bounded so that one request cannot slow
    the engine loop every other stream shares."""

    max_prompt_bytes: int = 0          # UTF-8 bytes of a text prompt; 0 = 16 per token of the prompt limit
    max_stop_strings: int = 64
    max_stop_bytes: int = 4096         # all stop strings together, UTF-8
    max_stop_token_ids: int = 1024
    max_cache_salt_bytes: int = 256
    max_request_id_chars: int = 128    # printable characters

    def prompt_bytes(self, max_prompt_tokens: int) -> int:
        """The byte limit of a text prompt when the prompt limit is ``max_prompt_tokens`` tokens."""
        return self.max_prompt_bytes or max(BYTES_PER_PROMPT_TOKEN * max_prompt_tokens, 65536)


# A token is rarely over a few bytes of text; 16 leaves room for any script.
BYTES_PER_PROMPT_TOKEN = 16


@dataclass(slots=True, frozen=True)
class Limits:
    max_model_len: int          # context limit (tokens)
    vocab_size: int
    max_n: int = 8
    max_prompt_tokens: int = 0  # 0 = max_model_len - 1
    caps: RequestCaps = RequestCaps()
    stream_interval: int = 1    # tokens per streamed delta when a request sets none (--stream-interval)

    @property
    def prompt_token_limit(self) -> int:
        return min(self.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1)


@dataclass(slots=True, frozen=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # a set: looked up at every sampled token
    stop_max_chars: int = 0     # the longest stop string (the text held back while it might still match)
    ignore_eos: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0                        # alternatives per sampled token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), distinct ids
    # Tokens per streamed delta (at most max_tokens: then each completion is
    # sent once, when it ends). Fewer, larger deltas cost the gateway and the
    # client less per token.
    stream_interval: int = 1
    penalized: bool = False     # a penalty is on: the executor keeps the sequence's tokens
    processed: bool = False     # any of penalties, min_p, logit bias, min_tokens masking: extra Execute columns

    @property
    def num_completions(self) -> int:
        return self.beam_width if self.beam_width > 1 else self.n


@dataclass(slots=True)
class RawParams:
    """Sampling fields as they arrive (proto3 zeros mean "unset" where noted;
    the gRPC servicer maps them, the HTTP layer passes None when absent)."""

    max_tokens: int | None = None   # None = the rest of the context
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
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None = unset -> 1
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stream_interval: int = 0    # tokens per streamed delta; 0 = the gateway's default


# A stream_interval that sends each completion once, when it ends (capped to max_tokens).
FINAL_ONLY = 2**31 - 1


def _bad(message: str, param: str) -> InvalidArgument:
    return InvalidArgument(message, param=param)


def _finite_in(value: float, lo: float, hi: float, name: str) -> float:
    if not math.isfinite(value) or not lo <= value <= hi:
        raise _bad(f"{name} must be in [{lo:g}, {hi:g}], got {value}", name)
    return float(value)


def _check_processing(raw: RawParams, limits: Limits) -> dict:
    """Penalties, min_p, logit bias, top logprobs: the SamplingSpec fields they give."""
    presence = _finite_in(raw.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, "presence_penalty")
    frequency = _finite_in(raw.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, "frequency_penalty")
    repetition = 1.0 if raw.repetition_penalty is None else raw.repetition_penalty
    if not math.isfinite(repetition) or repetition <= 0:
        raise _bad(f"repetition_penalty must be finite and > 0, got {raw.repetition_penalty}", "repetition_penalty")
    min_p = _finite_in(raw.min_p, 0.0, 1.0, "min_p")
    if len(raw.logit_bias) > MAX_LOGIT_BIAS:
        raise _bad(f"logit_bias has {len(raw.logit_bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    for token, bias in raw.logit_bias.items():
        if not 0 <= token < limits.vocab_size:
            raise _bad(f"logit_bias token id {token} is outside the vocabulary (size {limits.vocab_size})",
                       "logit_bias")
        if not math.isfinite(bias) or abs(bias) > MAX_ABS_BIAS:
            raise _bad(f"logit_bias values must be in [-{MAX_ABS_BIAS:g}, {MAX_ABS_BIAS:g}], got {bias}",
                       "logit_bias")
    if not 0 <= raw.top_logprobs <= MAX_TOP_LOGPROBS:
        raise _bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {raw.top_logprobs}", "top_logprobs")
    penalized = presence != 0 or frequency != 0 or repetition != 1
    return dict(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=float(repetition),
                min_p=min_p, logit_bias=tuple((int(t), float(b)) for t, b in raw.logit_bias.items() if b != 0),
                top_logprobs=raw.top_logprobs, penalized=penalized)


def _check_stops(raw: RawParams, limits: Limits) -> tuple[tuple[str, ...], frozenset[int]]:
    """Stop strings and stop token ids, counted before they are looked at."""
    caps = limits.caps
    if len(raw.stop) > caps.max_stop_strings:
        raise _bad(f"stop has {len(raw.stop)} strings; the limit is {caps.max_stop_strings} (max_stop_strings)",
                   "stop")
    stop = tuple(raw.stop)
    if any(s == "" for s in stop):
        raise _bad("stop strings must not be empty", "stop")
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in stop)
    if size > caps.max_stop_bytes:
        raise _bad(f"stop strings take {size} bytes; the limit is {caps.max_stop_bytes} (max_stop_bytes)", "stop")
    if len(raw.stop_token_ids) > caps.max_stop_token_ids:
        raise _bad(f"stop_token_ids has {len(raw.stop_token_ids)} ids; the limit is {caps.max_stop_token_ids} "
                   "(max_stop_token_ids)", "stop_token_ids")
    ids = frozenset(raw.stop_token_ids)
    if ids and not (0 <= min(ids) and max(ids) < limits.vocab_size):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise _bad(f"stop token id {bad} is outside the vocabulary (size {limits.vocab_size})", "stop_token_ids")
    return stop, ids


def validate(raw: RawParams, prompt_len: int, limits: Limits) -> SamplingSpec:
    if prompt_len == 0:
        raise _bad("prompt is empty", "prompt")
    if prompt_len > limits.prompt_token_limit:
        raise _bad(f"prompt has {prompt_len} tokens; the limit is {limits.prompt_token_limit}", "prompt")
    max_tokens = limits.max_model_len - prompt_len if raw.max_tokens is None else raw.max_tokens
    if max_tokens < 1:
        raise _bad("max_tokens must be >= 1", "max_tokens")
    if prompt_len + max_tokens > limits.max_model_len:
        raise _bad(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
                   f"limit of {limits.max_model_len}", "max_tokens")
    if not math.isfinite(raw.temperature) or raw.temperature < 0:
        raise _bad(f"temperature must be finite and >= 0, got {raw.temperature}", "temperature")
    top_p = raw.top_p or 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {raw.top_p}", "top_p")
    if raw.top_k < -1:
        raise _bad(f"top_k must be -1 (disabled) or >= 0, got {raw.top_k}", "top_k")
    n = raw.n or 1
    if n < 1 or n > limits.max_n:
        raise _bad(f"n must be in [1, {limits.max_n}], got {raw.n}", "n")
    beam = raw.beam_width or 1
    if beam > limits.max_n:
        raise _bad(f"beam_width must be <= {limits.max_n}, got {raw.beam_width}", "beam_width")
    if beam > 1 and raw.temperature != 0:
        raise _bad("beam search is deterministic: use temperature 0 with beam_width > 1", "temperature")
    if beam > 1 and n > beam:
        raise _bad(f"n ({n}) cannot exceed beam_width ({beam})", "n")
    length_penalty = raw.length_penalty or 1.0
    # Bounded: len ** penalty must stay a normal float (a penalty of -1e10
    # underflowed to 0 and the beam score divided by it).
    if not math.isfinite(length_penalty) or abs(length_penalty) > MAX_LENGTH_PENALTY:
        raise _bad(f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                   f"got {raw.length_penalty}", "length_penalty")
    stop, stop_token_ids = _check_stops(raw, limits)
    if raw.min_tokens < 0:
        raise _bad(f"min_tokens must be >= 0, got {raw.min_tokens}", "min_tokens")
    if raw.min_tokens > max_tokens:
        raise _bad("min_tokens must be <= max_tokens", "min_tokens")
    extra = _check_processing(raw, limits)
    stream_interval = raw.stream_interval or limits.stream_interval
    if stream_interval < 1:
        raise _bad(f"stream_interval must be >= 1 (or 0 for the gateway's default), got {raw.stream_interval}",
                   "stream_interval")
    if beam > 1:
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                              ("min_p", 0.0), ("logit_bias", ()), ("top_logprobs", 0)):
            if extra[name] != neutral:
                raise _bad(f"beam search does not take {name}", name)
    processed = bool(extra["penalized"] or extra["min_p"] or extra["logit_bias"] or raw.min_tokens)
    return SamplingSpec(max_tokens=max_tokens, temperature=float(raw.temperature), top_p=float(top_p),
                        top_k=-1 if raw.top_k in (0, -1) else raw.top_k, seed=raw.seed, n=n,
                        stop=stop, stop_token_ids=stop_token_ids, stop_max_chars=max(map(len, stop), default=0),
                        ignore_eos=raw.ignore_eos,
                        beam_width=beam, length_penalty=float(length_penalty), min_tokens=raw.min_tokens,
                        logprobs=raw.logprobs > 0 or raw.top_logprobs > 0, processed=processed,
                        stream_interval=min(stream_interval, max_tokens), **extra)


def validate_token_ids(token_ids: list[int], vocab_size: int) -> None:
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise _bad(f"prompt token id {t} is outside the vocabulary (size {vocab_size})", "prompt")


def logit_bias_for(spec: SamplingSpec, num_output: int, eos_ids: frozenset[int]) -> tuple[tuple[int, float], ...]:
    """The bias a completion with ``num_output`` tokens samples its next one
    with: the request's, and, until min_tokens are out, its stop tokens
    masked (-inf), as vLLM's min_tokens does."""
    if num_output >= spec.min_tokens:
        return spec.logit_bias
    stops = spec.stop_token_ids | (frozenset() if spec.ignore_eos else eos_ids)
    if not stops:
        return spec.logit_bias
    bias = dict(spec.logit_bias)
    bias.update((t, -math.inf) for t in stops)
    return tuple(bias.items())
