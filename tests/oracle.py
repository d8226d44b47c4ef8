"""The oracle every exactness test compares with: transformers' own
``generate`` on the same checkpoint, greedy, fp32, eager attention."""

from __future__ import annotations


class Oracle:
    """Memoised per (prompt, length, options).

    Args:
        fixed_length: ``greedy`` always returns ``max_new_tokens`` tokens
            (EOS is not a stop), as the executor tests drive fixed-length steps.
    """

    def __init__(self, model_dir: str, *, fixed_length: bool = False) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.fixed_length = fixed_length
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=torch.float32, attn_implementation="eager").eval()
        self._memo: dict[tuple, list[int]] = {}

    def greedy(self, prompt: list[int], max_new_tokens: int, **kw) -> list[int]:
        key = (tuple(prompt), max_new_tokens, tuple(sorted(kw.items())))
        if key not in self._memo:
            torch = self.torch
            ids = torch.tensor([prompt])
            if self.fixed_length:
                from transformers import GenerationConfig

                # eos_token_id=None would be refilled from the model's own generation config
                # (transformers 5); -1 is an id no token has: generation runs to the length.
                kw["generation_config"] = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                                                           eos_token_id=-1, pad_token_id=2)
            else:
                kw.update(max_new_tokens=max_new_tokens, do_sample=False)
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            self._memo[key] = out[0, len(prompt):].tolist()
            if self.fixed_length:
                assert len(self._memo[key]) == max_new_tokens
        return self._memo[key]

    def beams(self, prompt: list[int], max_new_tokens: int, num_beams: int) -> list[int]:
        tokens = self.greedy(prompt, max_new_tokens, num_beams=num_beams)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        for i, t in enumerate(tokens):  # a finished beam is padded after its EOS
            if t in eos:
                return tokens[: i + 1]
        return tokens

    def last_logits(self, tokens: list[int]):
        torch = self.torch
        with torch.no_grad():
            return self.model(torch.tensor([tokens])).logits[0, -1].float()
