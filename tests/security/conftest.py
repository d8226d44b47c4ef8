"""Security tests: TLS, tokens, limits, logs (docs/security.md)."""

import shutil

import pytest


@pytest.fixture(scope="session")
def security_model(demo_checkpoint):
    return demo_checkpoint


@pytest.fixture(scope="session")
def dev_certs(tmp_path_factory):
    """scripts/make-dev-ca.sh output: ca, server (both EKUs), client."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    from kvpager_tools.drills.runner import dev_certs as make

    return make(tmp_path_factory.mktemp("certs") / "dev")
