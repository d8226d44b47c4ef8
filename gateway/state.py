"""What the gateway tracks per request, per completion and per sequence.

A request has n completions (or beam_width beams); each live completion is
one memory-service sequence. Sequence ids are the gateway's own, unique for
the process lifetime. Mutated only by the engine loop.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from gateway.detokenizer import IncrementalDetokenizer
from kvpager.prefix_index.hashing import PromptChain
from kvpager.seq_status import SeqStatus
from gateway.params import SamplingSpec

# An input token the executor fills in with its own sample of step prev_step_id.
PLACEHOLDER = -1


class Finish(enum.IntEnum):
    """Mirrors kvpager.v1.FinishReason."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


@dataclass(slots=True)
class Output:
    """One streamed delta of one completion."""

    index: int
    token_ids: list[int]
    text: str
    finish: Finish = Finish.NONE
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, with top_logprobs
    cumulative_logprob: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass(slots=True, eq=False)
class Completion:
    index: int
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    finish: Finish = Finish.NONE
    cumulative_logprob: float = 0.0
    sent_text: int = 0          # characters of detok.text already streamed
    sent_tokens: int = 0        # tokens already streamed
    stop_text_end: int | None = None  # text is cut here when a stop string matched
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, most likely first


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    seed: int
    priority: int = 0
    cache_salt: str = ""                # the effective one: the tenant's namespace narrowed by the client's salt
    tenant: str = ""                    # who it belongs to (per-tenant quotas at the memory service)
    retention_s: float = 0.0            # its prompt's blocks stay cached this long after it ends
    arrival: int = 0
    executor_id: str = ""
    deadline: float | None = None       # loop.time() after which it is aborted
    skip_special_tokens: bool = False
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    completions: list[Completion] = field(default_factory=list)
    num_cached_tokens: int = 0
    admitted: bool = False              # scheduled at least once (prefix hit counted then)
    done: bool = False
    beam: object | None = None          # BeamState for beam search
    chain: PromptChain | None = None    # the prompt's block hashes per namespace (routing, admission)
    # perf_counter() times (gateway.request_stats): the API got it, first row in a plan, first / last sample
    arrival_s: float = 0.0
    scheduled_s: float = 0.0
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    owner: str = ""                     # the caller: only it may abort the request; ids are unique per owner

    @property
    def key(self) -> tuple[str, str]:
        return self.owner, self.request_id

    def usage(self) -> tuple[int, int, int]:
        return (len(self.prompt_ids), sum(len(c.output_ids) for c in self.completions), self.num_cached_tokens)


@dataclass(slots=True, eq=False)
class Seq:
    """The gateway's view of one memory-service sequence."""

    seq_id: int
    request: Request
    completion: Completion | None       # None for a beam-search parent before its first step
    tokens: list[int]                   # prompt + generated, as the memory service holds them
    executor_id: str
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    created: bool = False               # exists in the memory service
    sampled_first: bool = False         # n > 1: the first sample fans out into forks
    # Planning ahead (docs/architecture.md, "Steps planned ahead"):
    sampling: int = 0                   # rows in flight that sample its next token (results not applied yet)
    feed_ahead: bool = False            # the one in flight samples one token that a step planned now may feed
    placeholders: int = 0               # tokens the memory service holds placeholders for (replaced by appends)
    retries: int = 0                    # times its KV was lost and it was admitted again (gateway/recovery.py)
