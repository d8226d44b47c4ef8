"""How big an executor's KV pool and context limit are: pure functions of
its config, the model's own limit and, on CUDA, the memory left once the
model is loaded."""

from __future__ import annotations

import torch

from executor_service.config import ExecutorConfig
from executor_service.kv_pool import GIB, device_pool_budget, num_blocks_for_bytes
from kvpager.errors import ResourceExhausted
from kvpager.telemetry import get_logger

log = get_logger(__name__)


def asked_model_len(model_limit: int, asked: int | None) -> int:
    """The context limit asked for (``--max-model-len``), within the model's own."""
    if asked is None:
        return model_limit
    if asked < 1 or asked > model_limit:
        raise ValueError(f"max_model_len {asked} must be in [1, {model_limit}] for this model")
    return asked


def fit_model_len(max_model_len: int, asked: int | None, pool_tokens: int) -> int:
    """The context limit, no longer than the pool can hold: a sequence that
    could never fit is then refused when it arrives (the gateway validates
    against this limit) instead of after it has queued. An explicit
    --max-model-len over the pool is a configuration error (as in vLLM); the
    model's own limit is lowered, with a warning."""
    if max_model_len <= pool_tokens:
        return max_model_len
    if asked is not None:
        raise ValueError(f"max_model_len {max_model_len} does not fit the KV pool ({pool_tokens} tokens); "
                         f"give more blocks (--num-blocks / --kv-cache-gib) or a smaller --max-model-len")
    log.warning("context limit lowered to what the KV pool holds", model_max_len=max_model_len,
                pool_tokens=pool_tokens)
    return pool_tokens


def pool_num_blocks(config: ExecutorConfig, device: torch.device, per_block_bytes: int) -> int:
    """``--num-blocks`` if given; else on CUDA ``gpu_memory_fraction`` of the
    device less what is in use (call after loading the model); else
    ``kv_cache_gib``."""
    if config.num_blocks is not None:
        return config.num_blocks
    if device.type == "cuda":
        budget = device_pool_budget(device, config.gpu_memory_fraction)
    else:
        budget = int(config.kv_cache_gib * GIB)
    num_blocks = num_blocks_for_bytes(budget, per_block_bytes)
    if num_blocks < 1:
        raise ResourceExhausted(f"no memory left for the KV pool (budget {budget} bytes, block {per_block_bytes} bytes)")
    return num_blocks
