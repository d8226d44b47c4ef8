"""Shared by the drill tests (a module of its own: `conftest` names collide
across test directories)."""

import json


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
