"""The chat template: the checkpoint tokenizer's own, or ``--chat-template FILE``.

Messages are rendered with ``tokenizer.apply_chat_template(...,
add_generation_prompt=True)`` and tokenised without adding special tokens
(the template writes them), as vLLM does. A model with neither gets a 400
that says how to give one; a template that fails on the messages (many
raise on an unexpected role order) is a 400 with its message.
"""

from __future__ import annotations

from pathlib import Path

from kvpager.errors import InvalidArgument


def load_template(tokenizer, path: str | None) -> str | None:
    """The template text: the file's when given, else the tokenizer's (None: none)."""
    if path:
        return Path(path).read_text()
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    return template or None


class ChatTemplate:
    def __init__(self, tokenizer, path: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = load_template(tokenizer, path)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.template is None:
            raise InvalidArgument("this model has no chat template; start the gateway with --chat-template FILE "
                                  "(or use /v1/completions)", param="messages")
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception(), odd kwargs: the request's fault
            raise InvalidArgument(f"the chat template failed on these messages: {exc}", param="messages") from None

    def encode(self, messages: list[dict], add_generation_prompt: bool = True, *, add_special_tokens: bool = False,
               **kwargs) -> list[int]:
        text = self.render(messages, add_generation_prompt, **kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
