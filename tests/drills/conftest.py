"""Drills in CI: small versions on one stack per module (see kvpager.drills)."""

import json

import pytest


def assert_ok(result) -> dict:
    """The JSON summary, after checking the drill's common end check passed."""
    summary = result.to_dict()
    text = json.dumps(summary)  # it must serialise as printed by `kvpager drill --json`
    for key in ("requests", "completions", "failures_by_status", "leaked_blocks", "invariant_violations"):
        assert key in summary, key
    assert summary["ok"], text
    assert summary["leaked_blocks"] == 0 and not summary["invariant_violations"] and summary["healthy"], text
    assert not {"UNKNOWN", "INTERNAL"} & set(summary["failures_by_status"]), text
    return summary


@pytest.fixture(scope="session")
def drill_model(tmp_path_factory):
    """A small demo checkpoint shared by the drill modules."""
    from executor_service.demo_model import build_demo_model

    return str(build_demo_model(tmp_path_factory.mktemp("drills") / "demo", vocab_size=320,
                                max_position_embeddings=256))
