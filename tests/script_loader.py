"""Standalone scripts of the repo (``benchmarks/...``) imported as modules, so tests can run their helpers."""

import contextlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def script_module(rel_path: str):
    """The script at ``rel_path`` (from the repo root) as a module, for the block."""
    path = ROOT / rel_path
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
