"""Engine outputs -> OpenAI response bodies and stream chunks.

A request of several prompts (completions) is several engine requests;
choice ``prompt_index * n + completion index`` as OpenAI and vLLM number
them. Usage counts each prompt once and every choice's tokens;
``prompt_tokens_details.cached_tokens`` is the prefix-cache hit. Logprobs
are the raw model's (before penalties, bias and temperature: vLLM's
default), floored at -9999 so the JSON stays finite.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from gateway.state import Finish, Output

FINISH_REASONS = {Finish.STOP: "stop", Finish.LENGTH: "length", Finish.ABORT: "abort", Finish.ERROR: "error"}
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


class TokenText:
    """Token id -> its text, as logprobs show it (memoised: at most the vocabulary)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._memo.get(token_id)
        if text is None:
            text = self._memo[token_id] = self.tokenizer.decode([token_id])
        return text


@dataclass(slots=True)
class Usage:
    """Per engine request: its prompt and cache hit once, its choices' tokens."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> tokens
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, prompt_index: int, out: Output) -> None:
        if out.finish is not Finish.NONE:
            self.prompt_tokens[prompt_index] = out.prompt_tokens
            self.cached_tokens[prompt_index] = out.cached_prompt_tokens
            self.completion_tokens += out.completion_tokens

    def body(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}


class Renderer:
    """One response's bodies: ``chat`` or completions, its id, model and time."""

    def __init__(self, chat: bool, model: str, token_text: TokenText, n: int, request_id: str = "") -> None:
        self.chat = chat
        self.model = model
        self.text = token_text
        self.n = n
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # completions: characters streamed so far, per choice (text_offset)

    def index(self, prompt_index: int, out: Output) -> int:
        return prompt_index * self.n + out.index

    # ---- logprobs --------------------------------------------------------------------

    def logprobs(self, index: int, out: Output, offset: int) -> dict | None:
        if not out.logprobs:
            return None
        tokens = [self.text(t) for t in out.token_ids]
        tops = out.top_logprobs or [None] * len(tokens)
        if self.chat:
            content = []
            for tok, tok_id, lp, top in zip(tokens, out.token_ids, out.logprobs, tops):
                alts = [{"token": self.text(t), "logprob": _lp(v), "bytes": list(self.text(t).encode())}
                        for t, v in (top or ())]
                content.append({"token": tok, "logprob": _lp(lp), "bytes": list(tok.encode()), "top_logprobs": alts})
            return {"content": content}
        text_offset = []
        for tok in tokens:
            text_offset.append(offset)
            offset += len(tok)
        top_dicts = None
        if out.top_logprobs:
            top_dicts = []
            for tok, lp, top in zip(tokens, out.logprobs, tops):
                alts: dict[str, float] = {}
                for t, v in top or ():
                    alts.setdefault(self.text(t), _lp(v))  # tokens may share a text: keep the likelier
                alts.setdefault(tok, _lp(lp))  # the sampled token is always there (as vLLM)
                top_dicts.append(alts)
        return {"tokens": tokens, "token_logprobs": [_lp(v) for v in out.logprobs], "top_logprobs": top_dicts,
                "text_offset": text_offset}

    # ---- streaming --------------------------------------------------------------------

    def chunk(self, choices: list[dict], include_usage: bool) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if include_usage:
            body["usage"] = None
        return body

    def role_choice(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def stream_choice(self, index: int, out: Output, prefix: str = "") -> dict:
        finish = FINISH_REASONS.get(out.finish)
        text = prefix + out.text
        offset = self.offsets.get(index, 0)
        logprobs = self.logprobs(index, out, offset + len(prefix))
        self.offsets[index] = offset + len(text)
        if self.chat:
            return {"index": index, "delta": {"content": text} if text or out.token_ids else {},
                    "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def usage_chunk(self, usage: Usage) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": usage.body()}

    # ---- whole responses ----------------------------------------------------------------

    def response(self, choices: dict[int, list[Output]], usage: Usage, prefixes: dict[int, str]) -> dict:
        """choices: index -> its outputs in order; prefixes: echoed prompt text per index."""
        out_choices = []
        for index in sorted(choices):
            outs = choices[index]
            merged = Output(index, [t for o in outs for t in o.token_ids], "".join(o.text for o in outs),
                            outs[-1].finish if outs else Finish.NONE,
                            logprobs=[v for o in outs for v in o.logprobs],
                            top_logprobs=[v for o in outs for v in o.top_logprobs])
            prefix = prefixes.get(index, "")
            finish = FINISH_REASONS.get(merged.finish)
            logprobs = self.logprobs(index, merged, len(prefix))
            if self.chat:
                out_choices.append({"index": index, "message": {"role": "assistant", "content": merged.text},
                                    "logprobs": logprobs, "finish_reason": finish})
            else:
                out_choices.append({"index": index, "text": prefix + merged.text, "logprobs": logprobs,
                                    "finish_reason": finish})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out_choices, "usage": usage.body()}
