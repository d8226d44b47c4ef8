"""Test-wide setup. Keep it tiny."""

import os

# Triton reads this at import; CPU test runs use its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory) -> str:
    """The tiny random Llama (vocab 320, 256 positions) most stack tests run on, built once."""
    from kvpager_tools.demo_model import build_demo_model

    return str(build_demo_model(tmp_path_factory.mktemp("demo") / "demo", vocab_size=320,
                                max_position_embeddings=256))
