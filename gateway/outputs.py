"""Turn sampled tokens into streamed deltas: stop conditions, incremental
text, the held-back tail that might still become a stop string; and the
outbox that hands them to the streams."""

from __future__ import annotations

import asyncio

from gateway.state import Completion, Finish, Output, Request


def accept_token(req: Request, comp: Completion, token: int, logprob: float | None, eos_ids: frozenset[int],
                 total_len: int, max_model_len: int, top: list[tuple[int, float]] | None = None) -> Finish:
    """Record one sampled token of a completion (``top``: the most likely
    alternatives at its position); returns why it finished (or NONE)."""
    spec = req.spec
    comp.output_ids.append(token)
    if logprob is not None:
        comp.logprobs.append(logprob)
        comp.cumulative_logprob += logprob
    if top is not None:
        comp.top_logprobs.append(top)
    n_out = len(comp.output_ids)
    finish = Finish.NONE
    is_stop_token = (token in eos_ids and not spec.ignore_eos) or token in spec.stop_token_ids
    if is_stop_token and n_out > spec.min_tokens:
        finish = Finish.STOP  # the stop token's text is not part of the output
    else:
        comp.detok.add([token])
        if spec.stop and n_out > spec.min_tokens:
            text = comp.detok.text
            start = max(0, comp.sent_text - spec.stop_max_chars)
            hits = [p for p in (text.find(s, start) for s in spec.stop) if p >= 0]
            if hits:
                comp.stop_text_end = min(hits)
                finish = Finish.STOP
    if finish is Finish.NONE and (n_out >= spec.max_tokens or total_len >= max_model_len):
        finish = Finish.LENGTH
    comp.finish = finish
    return finish


def first_at_once(req: Request) -> bool:
    """A completion's first token is streamed as soon as it is sampled, then
    deltas of ``stream_interval`` (as vLLM's stream interval: the time to the
    first token is the same whatever the interval), unless the interval
    covers the whole completion (``max_tokens``, non-streamed HTTP): then it
    goes once, when it ends."""
    return req.spec.stream_interval < req.spec.max_tokens


def take_output(req: Request, comp: Completion) -> Output | None:
    """The delta not yet streamed (None if there is nothing new, or, while it
    runs, fewer new tokens than the request's ``stream_interval`` after its
    first token: ``first_at_once``)."""
    if (comp.finish is Finish.NONE and len(comp.output_ids) - comp.sent_tokens < req.spec.stream_interval
            and not (comp.sent_tokens == 0 and first_at_once(req))):
        return None
    text = comp.detok.text
    if comp.finish is not Finish.NONE:
        end = comp.stop_text_end if comp.stop_text_end is not None else len(text)
    else:
        hold = max(req.spec.stop_max_chars - 1, 0)  # could still become a stop string
        end = max(comp.sent_text, len(text) - hold)
    new_tokens = comp.output_ids[comp.sent_tokens:]
    delta = text[comp.sent_text:end]
    if not new_tokens and not delta and comp.finish is Finish.NONE:
        return None
    out = Output(comp.index, new_tokens, delta, comp.finish,
                 logprobs=comp.logprobs[comp.sent_tokens:] if req.spec.logprobs else [],
                 top_logprobs=comp.top_logprobs[comp.sent_tokens:] if req.spec.top_logprobs else [],
                 cumulative_logprob=comp.cumulative_logprob)
    comp.sent_tokens = len(comp.output_ids)
    comp.sent_text = max(comp.sent_text, end)
    if comp.finish is not Finish.NONE:
        out.prompt_tokens, out.completion_tokens, out.cached_prompt_tokens = (
            len(req.prompt_ids), len(comp.output_ids), req.num_cached_tokens)
    return out


class Outbox:
    """Stream items (outputs, errors, end markers) not yet handed to their
    requests' queues. A step's tokens are released once the next step's
    Executes are on their way, so the streams run while the executors compute
    (at once when their executor already runs the step planned ahead)."""

    END = None  # on a request's queue: the stream is over

    def __init__(self) -> None:
        self._items: list[tuple[asyncio.Queue, object]] = []

    def emit(self, req: Request, item) -> None:
        """Queue an item for ``req`` (in order)."""
        self._items.append((req.outputs, item))

    def flush(self) -> None:
        items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)
