"""The demo checkpoint and its transformers oracle, built once for the gateway
tests (a module that needs another shape defines its own `model`)."""

from __future__ import annotations

import pytest
from oracle import Oracle


@pytest.fixture(scope="session")
def model(demo_checkpoint):
    return demo_checkpoint


@pytest.fixture(scope="session")
def oracle(model):
    return Oracle(model)
