"""Request bodies -> typed requests.

Each field is type-checked here (a wrong JSON type is a 400 naming the
field); ranges and combinations are checked by ``gateway.params.validate``,
the same function, with the same messages, as gRPC. Defaults are OpenAI's
(temperature 1, completions' max_tokens 16) and vLLM's for its extensions
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens = true, priority, cache_salt). ``null`` is the same as
absent. Unknown fields are ignored (as vLLM does); known fields whose
feature kvpager lacks (suffix, tools, response formats other than text,
best_of other than n) are refused rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.http.errors import bad_request
from gateway.params import FINAL_ONLY, RawParams

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

_MISSING = object()


class Body:
    """Typed access to a JSON object's fields."""

    def __init__(self, data) -> None:
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        self.data = data

    def _get(self, name: str):
        value = self.data.get(name)
        return _MISSING if value is None else value

    def has(self, name: str) -> bool:
        return self._get(name) is not _MISSING

    def str(self, name: str, default: str | None = None) -> str | None:
        v = self._get(name)
        if v is _MISSING:
            return default
        if not isinstance(v, str):
            raise bad_request(f"{name} must be a string", name)
        return v

    def bool(self, name: str, default: bool = False) -> bool:
        v = self._get(name)
        if v is _MISSING:
            return default
        if not isinstance(v, bool):
            raise bad_request(f"{name} must be true or false", name)
        return v

    def int(self, name: str, default: int | None = None) -> int | None:
        v = self._get(name)
        if v is _MISSING:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad_request(f"{name} must be an integer", name)
        return v

    def float(self, name: str, default: float) -> float:
        v = self._get(name)
        if v is _MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad_request(f"{name} must be a number", name)
        return float(v)

    def int_list(self, name: str) -> list[int]:
        v = self._get(name)
        if v is _MISSING:
            return []
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise bad_request(f"{name} must be a list of integers", name)
        return v

    def object(self, name: str) -> dict:
        v = self._get(name)
        if v is _MISSING:
            return {}
        if not isinstance(v, dict):
            raise bad_request(f"{name} must be an object", name)
        return v


# ---- the fields both endpoints share ------------------------------------------------------


def _stop(body: Body) -> list[str]:
    v = body._get("stop")
    if v is _MISSING:
        return []
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("stop must be a string or a list of strings", "stop")
    return v


def _logit_bias(body: Body) -> dict[int, float]:
    out = {}
    for key, value in body.object("logit_bias").items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request("logit_bias values must be numbers", "logit_bias")
        out[token] = float(value)
    return out


def _seed(body: Body) -> int | None:
    seed = body.int("seed")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise bad_request("seed must fit in 64 bits", "seed")
    return seed


def sampling(body: Body, max_tokens: int | None) -> RawParams:
    """The sampling fields of either endpoint (``max_tokens``: already read)."""
    n = body.int("n", 1)
    best_of = body.int("best_of")
    if best_of is not None and best_of != n:
        raise bad_request("best_of is not supported (use n)", "best_of")
    top_k = body.int("top_k", -1)
    return RawParams(
        max_tokens=max_tokens, temperature=body.float("temperature", 1.0), top_p=body.float("top_p", 1.0),
        top_k=top_k, seed=_seed(body), n=n, stop=_stop(body), stop_token_ids=body.int_list("stop_token_ids"),
        ignore_eos=body.bool("ignore_eos"), min_tokens=body.int("min_tokens", 0),
        presence_penalty=body.float("presence_penalty", 0.0), frequency_penalty=body.float("frequency_penalty", 0.0),
        repetition_penalty=body.float("repetition_penalty", 1.0) if body.has("repetition_penalty") else None,
        min_p=body.float("min_p", 0.0), logit_bias=_logit_bias(body))


def _top_p_zero(params: RawParams) -> None:
    # RawParams reads a top_p of 0 as unset (proto3); over HTTP an explicit 0 is out of range.
    if params.top_p == 0:
        raise bad_request(f"top_p must be in (0, 1], got {params.top_p}", "top_p")


def _n(params: RawParams) -> None:
    if params.n == 0:  # RawParams reads 0 as unset
        raise bad_request("n must be >= 1", "n")


@dataclass(slots=True)
class Common:
    """What both endpoints carry besides the prompt."""

    model: str | None
    params: RawParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    cache_salt: str = ""
    skip_special_tokens: bool = True
    request_id: str = ""               # the client's (vLLM's extension field); wins over X-Request-Id
    retention_s: float = 0.0           # keep the prompt's blocks cached this long after (extension)


def _common(body: Body, max_tokens: int | None) -> Common:
    params = sampling(body, max_tokens)
    _top_p_zero(params)
    _n(params)
    stream = body.bool("stream")
    options = body.object("stream_options")
    if options and not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    include_usage = Body(options).bool("include_usage") if options else False
    if not stream:  # the response is built once the completions end: no deltas in between
        params.stream_interval = FINAL_ONLY
    priority = body.int("priority", 0)
    if not -(2**31) <= priority < 2**31:
        raise bad_request("priority must fit in 32 bits", "priority")
    return Common(model=body.str("model"), params=params, stream=stream, include_usage=include_usage,
                  priority=priority, cache_salt=body.str("cache_salt", ""),
                  skip_special_tokens=body.bool("skip_special_tokens", True),
                  request_id=body.str("request_id", "") or "", retention_s=body.float("retention_s", 0.0))


# ---- /v1/completions ---------------------------------------------------------------------------


@dataclass(slots=True)
class CompletionRequest:
    common: Common
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False


def _prompts(body: Body) -> list[str | list[int]]:
    v = body._get("prompt")
    if v is _MISSING:
        raise bad_request("prompt is required", "prompt")
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(isinstance(p, str) for p in v):
            return list(v)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return [list(v)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in v):
            return [list(p) for p in v]
    if isinstance(v, list) and not v:
        raise bad_request("prompt is empty", "prompt")
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                      "prompt")


def completion_request(data) -> CompletionRequest:
    body = Body(data)
    if body.str("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    max_tokens = body.int("max_tokens", COMPLETIONS_MAX_TOKENS)
    common = _common(body, max_tokens)
    logprobs = body.int("logprobs")
    if logprobs is not None:  # the sampled token's logprob, and this many alternatives
        if logprobs < 0:
            raise bad_request(f"logprobs must be >= 0, got {logprobs}", "logprobs")
        common.params.logprobs, common.params.top_logprobs = 1, logprobs
    echo = body.bool("echo")
    if echo and logprobs is not None:
        raise bad_request("echo with logprobs is not supported (the prompt's logprobs are not computed)", "echo")
    return CompletionRequest(common, _prompts(body), echo)


# ---- /v1/chat/completions ------------------------------------------------------------------------


@dataclass(slots=True)
class ChatRequest:
    common: Common
    messages: list[dict] = field(default_factory=list)
    add_generation_prompt: bool = True
    template_kwargs: dict = field(default_factory=dict)


def _content(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def messages(data) -> list[dict]:
    """A chat's messages as the template takes them: role and text content."""
    if not isinstance(data, list) or not data:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(data):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a role", "messages")
        msg = {"role": m["role"], "content": _content(m.get("content"), i)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def chat_request(data) -> ChatRequest:
    body = Body(data)
    if body.has("tools") and body.data["tools"]:
        raise bad_request("tools are not supported", "tools")
    fmt = body.object("response_format")
    if fmt and fmt.get("type") not in (None, "text"):
        raise bad_request(f"response_format {fmt.get('type')!r} is not supported", "response_format")
    # max_completion_tokens supersedes max_tokens; omitted: the rest of the context (as vLLM)
    max_tokens = body.int("max_completion_tokens", body.int("max_tokens"))
    common = _common(body, max_tokens)
    top = body.int("top_logprobs")
    if body.bool("logprobs"):
        common.params.logprobs, common.params.top_logprobs = 1, top or 0
    elif top:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    kwargs = body.object("chat_template_kwargs")
    return ChatRequest(common, messages(body.data.get("messages")), body.bool("add_generation_prompt", True), kwargs)


# ---- /tokenize, /detokenize --------------------------------------------------------------------


@dataclass(slots=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


def tokenize_request(data) -> TokenizeRequest:
    body = Body(data)
    chat = body.has("messages")
    if chat == body.has("prompt"):
        raise bad_request("give either prompt or messages", "prompt")
    return TokenizeRequest(model=body.str("model"), prompt=body.str("prompt"),
                           messages=messages(body.data["messages"]) if chat else None,
                           add_special_tokens=body.bool("add_special_tokens", not chat),
                           add_generation_prompt=body.bool("add_generation_prompt", True),
                           return_token_strs=body.bool("return_token_strs"))


def detokenize_request(data) -> tuple[str | None, list[int]]:
    body = Body(data)
    if not body.has("tokens"):
        raise bad_request("tokens is required", "tokens")
    return body.str("model"), body.int_list("tokens")
