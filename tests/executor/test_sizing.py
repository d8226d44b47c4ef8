"""executor_service.sizing: the pool's blocks and the context limit."""

import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.sizing import asked_model_len, fit_model_len, pool_num_blocks
from kvpager.errors import ResourceExhausted

CPU = torch.device("cpu")


def test_asked_model_len_stays_within_the_model():
    assert asked_model_len(4096, None) == 4096
    assert asked_model_len(4096, 512) == 512
    for bad in (0, 4097):
        with pytest.raises(ValueError, match=r"must be in \[1, 4096\]"):
            asked_model_len(4096, bad)


def test_fit_model_len_lowers_the_models_limit_but_refuses_an_asked_one():
    assert fit_model_len(256, None, 1024) == 256
    assert fit_model_len(256, 256, 256) == 256
    assert fit_model_len(4096, None, 1024) == 1024  # lowered, with a warning
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        fit_model_len(4096, 4096, 1024)


def test_pool_num_blocks_precedence():
    assert pool_num_blocks(ExecutorConfig(model="m", num_blocks=7), CPU, 1 << 20) == 7
    assert pool_num_blocks(ExecutorConfig(model="m", kv_cache_gib=1.0), CPU, 1 << 20) == 1024
    with pytest.raises(ResourceExhausted, match="no memory left"):
        pool_num_blocks(ExecutorConfig(model="m", kv_cache_gib=0.5), CPU, 1 << 30)
