"""`kvpager bench blockmap` on a small pool: the page streams, the JSON has
its figures and they are sane (the full figures: docs/blockmap.md)."""

from __future__ import annotations

import argparse
import shutil

import pytest

pytestmark = pytest.mark.timeout(240)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium (scripts/install.sh --test) is missing")
def test_bench_blockmap_small_pool():
    pytest.importorskip("playwright.async_api")
    import asyncio

    from kvpager_tools.bench.blockmap import add_bench_parser, run

    p = argparse.ArgumentParser()
    add_bench_parser(p.add_subparsers())
    args = p.parse_args(["blockmap", "--num-blocks", "2048", "--requests", "8", "--concurrency", "4",
                         "--max-tokens", "8", "--interval-ms", "100"])
    out = asyncio.run(run(args))
    assert out["num_blocks"] == 2048 and out["updates_seen"] >= 5
    assert out["first_update_bytes"] > 2048  # every block, base64
    assert 0 < out["update_bytes"]["median"] < out["first_update_bytes"]
    assert out["page_frame_ms"]["median"] > 0 and out["server_update_ms"]["full"] > 0
    assert out["cached_blocks_after"] > 0
