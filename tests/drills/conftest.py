"""Drills in CI: small versions on one stack per module (see kvpager.drills)."""

import pytest


@pytest.fixture(scope="session")
def drill_model(tmp_path_factory):
    """A small demo checkpoint shared by the drill modules."""
    from executor_service.demo_model import build_demo_model

    return str(build_demo_model(tmp_path_factory.mktemp("drills") / "demo", vocab_size=320,
                                max_position_embeddings=256))
