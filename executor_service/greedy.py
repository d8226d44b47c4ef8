"""The greedy shortcut: a step whose every row takes one greedy token and
asks for nothing else (no logprobs, no top alternatives, no logit bias, no
penalty) is sampled by each row's argmax alone.

``sample`` (executor_service.sampler) gives the same tokens for such a step,
but builds its inputs as tensors and runs its general bookkeeping first:
~0.25 ms a step on the 2-core EPYC, 5 % of a 30M model's 32-sequence decode
forward (docs/benchmarks.md). Offline batches and greedy chat traffic are
mostly such steps.
"""

from __future__ import annotations

import numpy as np
import torch

from executor_service.step import Sampling
from kvpager_kernels.greedy import argmax_rows


def greedy_only(s: Sampling, n: int) -> bool:
    """Whether each of the ``n`` rows of a checked step (defaults filled in)
    samples exactly one greedy token and nothing reads or changes its logits
    but the argmax."""
    if s.return_logprobs or (s.bias_token_ids is not None and len(s.bias_token_ids)):
        return False
    penalized = s.penalized(n)
    if penalized is not None and penalized.any():
        return False
    return bool((s.num_samples == 1).all() and (s.temperature <= 0).all() and not s.num_top_logprobs.any())


def greedy_tokens(logits: torch.Tensor) -> np.ndarray:
    """logits [n, V] -> int32 [n]: each row's first maximum (``sample``'s greedy answer)."""
    return argmax_rows(logits).to(torch.int32).cpu().numpy()
