"""The committed stubs in kvpager/v1 are what the .proto sources generate."""

from __future__ import annotations

import pytest

from kvpager_tools import protogen

pytest.importorskip("grpc_tools")

STALE = "stubs are stale: run `python -m kvpager_tools.protogen`"


def test_committed_stubs_match_protos(tmp_path):
    generated = protogen.generate(tmp_path)
    committed_dir = protogen.ROOT / "kvpager" / "v1"
    names = {p.name for p in generated}
    committed = {p.name for p in committed_dir.iterdir() if p.suffix in (".py", ".pyi")}
    assert names == committed, f"{STALE} (files differ: {sorted(names ^ committed)})"
    for path in generated:
        fresh = protogen.normalized(path.read_text())
        current = protogen.normalized((committed_dir / path.name).read_text())
        assert fresh == current, f"{STALE} ({path.name} differs)"
