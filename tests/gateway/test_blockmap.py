"""The live block map in a real headless browser (Debian's chromium, driven
by Playwright) against the real in-process stack under load: the page loads
offline, the grid has one cell per block, its counts equal `kvpager blocks
--json` (the engine held between two steps, sequences mid-generation),
selecting a sequence highlights exactly its blocks, in logical order; the
routes' errors and the admin token."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

from memory_service.service import MemoryConfig, MemoryServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).resolve().parents[2]
COUNTED = ("total_blocks", "used_blocks", "free_blocks", "cached_blocks", "num_sequences",
           "num_swapped_sequences", "swap_free_blocks")
HIGHLIGHT = [18, 184, 134]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=48, block_size=4, swap_blocks=16, swap_min_tokens=8,
                          preemption_mode="threshold",
                          memory_kw={"http_port": 0})
    yield s
    await s.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def browser():
    if CHROMIUM is None:
        pytest.skip("chromium (Debian's package; scripts/install.sh --test installs it) is missing")
    playwright = pytest.importorskip("playwright.async_api")
    async with playwright.async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        await b.close()


class Gate:
    """Holds the gateway's Step calls: the memory service's state stays as it
    is, sequences mid-generation, until ``open``."""

    def __init__(self, memory_client, open_steps: int | None = None) -> None:
        self.client, self.step = memory_client, memory_client.step
        self.event = asyncio.Event()
        self.event.set()
        self.open_steps = open_steps  # Steps let through before it closes by itself (None: until close())

        async def step(request, timeout_s=None):
            if self.open_steps is not None:
                if self.open_steps <= 0:
                    self.event.clear()
                self.open_steps -= 1
            await self.event.wait()
            return await self.step(request, timeout_s)

        memory_client.step = step

    def close(self) -> None:
        self.event.clear()

    def open(self) -> None:
        self.event.set()

    def restore(self) -> None:
        self.event.set()
        self.client.step = self.step


def kvpager_blocks_json(address: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvpager_tools.cli", "blocks", "--address", address, "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    return json.loads(out.stdout)


async def page_counts(page, executor_id: str) -> dict:
    return await page.evaluate("""id => Object.fromEntries([...document.querySelectorAll(
        `section[data-executor="${id}"] dd[data-k]`)].map(d => [d.dataset.k, Number(d.textContent)]))""", executor_id)


async def highlighted_cells(page, executor_id: str) -> list[int]:
    """Cells whose pixels (a corner, away from the path and the numbers) are the highlight colour."""
    return await page.evaluate("""([id, hl]) => {
        const v = window.blockmap.S.views.get(id), L = v.layout;
        const ctx = document.querySelector(`section[data-executor="${id}"] canvas.grid`).getContext("2d");
        const out = [];
        for (let i = 0; i < v.cells.length; i++) {
          const x = (i % L.cols) * L.s, y = Math.floor(i / L.cols) * L.s, d = ctx.getImageData(x + 1, y + 1, 1, 1).data;
          if (d[0] === hl[0] && d[1] === hl[1] && d[2] === hl[2]) out.push(i);
        }
        return out; }""", [executor_id, HIGHLIGHT])


async def until(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_page_grid_counts_and_selection_match_the_memory_service(stack, browser, tmp_path):
    page = await browser.new_page(viewport={"width": 1300, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    external: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(stack.memory.blockmap_url) else external.append(r.url))
    await page.goto(stack.memory.blockmap_url)
    await until(lambda: page.evaluate("window.blockmap.stats().updates >= 2"), what="the first updates")
    assert await page.evaluate("window.blockmap.S.views.get('executor-0').cells.length") == 48

    # Closes by itself after a few Steps (prefills and some decodes): on a quiet machine the
    # whole load finishes in ~0.3 s, before a close() timed from here would land.
    gate = Gate(stack.gateway.engine.memory, open_steps=6)
    prefix = list(range(10, 22))
    load = asyncio.ensure_future(asyncio.gather(
        *[generate(stack.gw, prefix + [60 + i] * 5, max_tokens=24, ignore_eos=True, request_id=f"map-{i}")
          for i in range(5)],
        generate(stack.gw, list(range(70, 79)), max_tokens=24, ignore_eos=True, n=2, seed=1, temperature=1.0,
                 request_id="map-fork")))
    try:
        manager = stack.memory.state.manager
        await until(lambda: asyncio.sleep(0, sum(1 for s in manager.seqs.values() if s.blocks) >= 3),
                    what="sequences holding blocks")
        await asyncio.sleep(0.3)
        gate.close()
        await asyncio.sleep(0.5)  # a Step in flight lands; then nothing changes until the gate opens
        step_id = manager.last_step_id
        await until(lambda: page.evaluate(f"window.blockmap.S.lastStep === {step_id}"), what="the page at the step")
        await asyncio.sleep(0.6)  # the page applies an update or two more: nothing changed, still equal
        cli = await asyncio.to_thread(kvpager_blocks_json, stack.memory.address)
        ex = next(e for e in cli["executors"] if e["executor_id"] == "executor-0")
        shown = await page_counts(page, "executor-0")
        assert ex["num_sequences"] >= 3 and ex["used_blocks"] > 0
        for key in COUNTED:
            assert shown[key] == ex[key], (key, shown[key], ex[key])
        assert shown["grid_cells"] == ex["total_blocks"] == 48
        assert shown["grid_used"] == ex["used_blocks"]
        assert shown["grid_cached"] == ex["cached_blocks"]
        assert shown["grid_free"] == ex["free_blocks"]
        rows = await page.evaluate("[...document.querySelectorAll('tbody tr[data-seq]')].map(r => r.dataset.seq)")
        assert sorted(rows) == sorted(str(i) for i in manager.executors["executor-0"].seq_ids)
        shown_requests = await page.evaluate(
            "[...document.querySelectorAll('tbody tr[data-seq] td:nth-child(2)')].map(t => t.textContent)")
        assert sorted(shown_requests) == sorted(manager.seqs[i].request_id for i in manager.executors["executor-0"].seq_ids)
        assert any(r.startswith("map-") for r in shown_requests)

        # select the sequence with the most blocks (some shared with the others): exactly its blocks light up
        seq = max((s for s in manager.seqs.values() if s.blocks), key=lambda s: len(s.blocks))
        version = await page.evaluate("window.blockmap.S.tableVersion || 0")
        await page.click(f'tbody tr[data-seq="{seq.seq_id}"]')
        await until(lambda: page.evaluate(f"(window.blockmap.S.tableVersion || 0) > {version}"), what="the table")
        assert sorted(await highlighted_cells(page, "executor-0")) == sorted(seq.block_ids)
        text = await page.text_content('section[data-executor="executor-0"] .table-view')
        assert ", ".join(f"{i}→{b}" for i, b in enumerate(seq.block_ids)) in text
        assert await page.evaluate("document.querySelector('tr.selected').dataset.seq") == str(seq.seq_id)
        shot = tmp_path / "blockmap.png"
        await page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("KVPAGER_SCREENSHOT"):
            shutil.copy(shot, os.environ["KVPAGER_SCREENSHOT"])
    finally:
        gate.restore()
    await load
    await stack.wait_idle()
    await until(lambda: page.evaluate(
        "document.querySelector('section[data-executor=\"executor-0\"] dd[data-k=\"used_blocks\"]').textContent === '0'"),
        what="the page to show every block back")
    stats = await page.evaluate("window.blockmap.stats()")
    assert stats["updatesPerSec"] >= 2, stats
    assert not errors and not external
    await page.close()


async def test_routes_refuse_bad_input(stack):
    base = stack.memory.blockmap_url
    async with httpx.AsyncClient(base_url=base) as http:
        assert (await http.get("api/stream?interval_ms=5")).status_code == 400
        assert (await http.get("api/stream?interval_ms=abc")).status_code == 400
        assert (await http.get("api/sequences/abc")).status_code == 400
        assert (await http.get("api/sequences/12345")).status_code == 404
        assert (await http.get("nothing/here")).status_code == 404
        assert (await http.post("api/frame")).status_code == 405
        assert (await http.get("health")).status_code == 200
        assert "kvpager_kv_used_blocks" in (await http.get("metrics")).text
        frame = (await http.get("api/frame")).json()
        assert [e["id"] for e in frame["executors"]] == ["executor-0"] and "cells_b64" in frame["executors"][0]


@pytest.mark.parametrize("open_read_only", [False, True])
async def test_the_admin_token_guards_the_data_as_it_guards_the_read_only_rpcs(open_read_only):
    server = await MemoryServer(MemoryConfig(port=0, http_port=0, admin_token="s3cret",
                                             open_read_only=open_read_only)).start()
    try:
        async with httpx.AsyncClient(base_url=server.blockmap_url) as http:
            assert (await http.get("")).status_code == 200  # the page holds no data; it asks for the token
            for path in ("api/frame", "api/sequences/1"):
                plain = await http.get(path)
                good = await http.get(path, headers={"Authorization": "Bearer s3cret"})
                bad = await http.get(path, headers={"Authorization": "Bearer nope"})
                assert plain.status_code == bad.status_code == (404 if open_read_only and path != "api/frame"
                                                                else 200 if open_read_only else 401)
                assert good.status_code in (200, 404)
    finally:
        await server.stop(0)


async def test_the_page_asks_for_the_admin_token_and_then_streams(browser):
    server = await MemoryServer(MemoryConfig(port=0, http_port=0, admin_token="s3cret")).start()
    try:
        page = await browser.new_page()
        await page.goto(server.blockmap_url)
        await page.wait_for_selector("#auth", state="visible")
        assert "admin token" in await page.text_content("#status")
        await page.fill("#token", "wrong")
        await page.click("#auth button")
        await page.wait_for_selector("#auth", state="visible")  # refused again
        await page.fill("#token", "s3cret")
        await page.click("#auth button")
        await until(lambda: page.evaluate("window.blockmap.stats().updates >= 2"), what="updates with the token")
        assert await page.text_content("#status") == "live"
        await page.close()
    finally:
        await server.stop(0)
