"""The demo checkpoint and its transformers oracle, built once for the gateway
tests (a module that needs another shape defines its own `model`)."""

from __future__ import annotations

import pytest
from gateway_harness import Oracle


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    from executor_service.demo_model import build_demo_model

    return str(build_demo_model(tmp_path_factory.mktemp("gw") / "demo", vocab_size=320,
                                max_position_embeddings=256))


@pytest.fixture(scope="session")
def oracle(model):
    return Oracle(model)
