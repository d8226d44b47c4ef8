"""scripts/gpu_checks.sh is what a session lent a GPU runs, once, in minutes:
it must name every GPU-marked test file (it lists them instead of collecting
whole directories, which would build the C++ CPU kernels and import what
only CPU tests need) and parse."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _marks_gpu(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.Attribute) and node.attr == "gpu"
               and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
               for node in ast.walk(tree))


def test_every_gpu_marked_test_file_is_run_by_the_script():
    script = (ROOT / "scripts/gpu_checks.sh").read_text()
    listed = set(re.findall(r"tests/[\w/]+\.py", script))
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if _marks_gpu(p)}
    assert marked, "no GPU-marked tests found: the scan is broken"
    assert marked == listed, f"marked but not run: {sorted(marked - listed)}; run but not marked: {sorted(listed - marked)}"
    for bench in re.findall(r"benchmarks/\w+\.py", script):
        assert (ROOT / bench).is_file(), bench


def test_the_scripts_parse():
    for script in ("gpu_checks.sh", "gpu_wheels.sh"):
        out = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True,
                             timeout=30, check=False)
        assert out.returncode == 0, out.stderr
