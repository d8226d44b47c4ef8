"""`kvpager drill NAME --json`: every drill is registered with its options,
and a run prints the JSON summary and exits 0 when the check passes."""

from __future__ import annotations

import json
import subprocess
import sys

from kvpager_tools.cli import build_parser
from kvpager_tools.drills import DRILLS


def test_every_drill_has_a_parser_with_its_options():
    parser = build_parser()
    for name in DRILLS:
        args = parser.parse_args(["drill", name, "--json", "--seed", "3"])
        assert args.drill_name == name and args.json and args.seed == 3
    assert parser.parse_args(["drill", "load", "--streams", "7"]).streams == 7
    assert parser.parse_args(["drill", "soak", "--duration-s", "5"]).duration_s == 5.0
    assert parser.parse_args(["drill", "memory-restart", "--no-unconfirmed-round"]).unconfirmed_round is False


def test_cli_run_prints_the_summary(demo_checkpoint):
    proc = subprocess.run(
        [sys.executable, "-m", "kvpager_tools.cli", "drill", "bad-input", "--json", "--payloads-per-method", "1",
         "--model", demo_checkpoint, "--num-blocks", "64", "--block-size", "8", "--max-model-len", "128"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["drill"] == "bad-input" and summary["ok"]
    assert summary["leaked_blocks"] == 0 and summary["invariant_violations"] == []


def test_a_bf16_stack_is_drilled_without_comparing_outputs(demo_checkpoint):
    """bf16 rounding moves with the batch, so a bf16 stack's outputs are
    counted as not compared (their tokens flip under load, which is not a
    fault), and everything else is still checked."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvpager_tools.cli", "drill", "load", "--json", "--streams", "24", "--max-tokens", "8",
         "--compare-outputs", "4", "--dtype", "bfloat16", "--model", demo_checkpoint, "--num-blocks", "128",
         "--block-size", "8", "--max-model-len", "128"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["ok"] and summary["leaked_blocks"] == 0 and summary["completions"] == 24, summary
    assert summary["figures"]["outputs_not_compared"] == 4 and "outputs_compared" not in summary["figures"]
