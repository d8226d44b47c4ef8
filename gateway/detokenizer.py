"""Incremental detokenization: text deltas as tokens arrive.

Byte-level BPE can split one character over several tokens, and decoding a
token alone can change how its neighbours render; so each step decodes a
short window (a few tokens already emitted + the new ones) and emits only
what the window adds beyond the already-emitted part, holding back a
trailing replacement character until the rest of the bytes arrive.
"""

from __future__ import annotations

_CONTEXT = 5  # tokens of already-rendered context kept in the window


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A fast tokenizer's Rust backend decodes exactly what tokenizer.decode(...,
        # clean_up_tokenization_spaces=False) returns, without its per-call Python
        # conversions (~16 -> ~2 us a call; two calls per streamed token).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the new text they complete (maybe "")."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
