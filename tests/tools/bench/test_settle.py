"""bc.settle: the wait between two engines' timed rounds (compare-vllm)."""

import subprocess
import sys
import time

from kvpager_tools.bench import common as bc

SPIN = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < {s}: pass\n"


def test_settle_waits_for_a_spinning_process_to_stop():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(s=1.2)])
    try:
        time.sleep(0.2)  # spinning now
        t0 = time.perf_counter()
        waited = bc.settle(0.0, max_s=8.0)
        assert time.perf_counter() - t0 >= 0.7  # not before the spinner's end
        assert waited >= 0.7
        assert spinner.poll() is not None  # it was done when settle returned
    finally:
        spinner.kill()
        spinner.wait()


def test_settle_sleeps_at_least_min_and_at_most_max():
    assert bc.settle(0.3, max_s=5.0) >= 0.3
    spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(s=5)])
    try:
        time.sleep(0.2)
        t0 = time.perf_counter()
        bc.settle(0.0, max_s=0.6)
        assert time.perf_counter() - t0 < 1.5  # gives up at max_s on a machine that stays busy
    finally:
        spinner.kill()
        spinner.wait()
