"""ThreadTuner: all cores on a quiet machine, one fewer soon after load
appears, all cores again soon after it goes (simulated step times)."""

from __future__ import annotations

from executor_service.cpu import ThreadTuner


def run(tuner: ThreadTuner, steps: int, times: dict[int, float], num_tokens: int = 32) -> list[int]:
    chosen = []
    for _ in range(steps):
        t = tuner.choose(num_tokens)
        tuner.record(num_tokens, t, times[t])
        chosen.append(t)
    return chosen


def test_quiet_machine_runs_nearly_every_step_on_every_core():
    tuner = ThreadTuner((2, 1))
    chosen = run(tuner, 256, {2: 1.0, 1: 1.8})
    assert chosen[0] == 2
    assert chosen.count(1) <= 256 // tuner.explore_every  # only the rare explorations


def test_each_size_class_starts_on_every_core():
    tuner = ThreadTuner((2, 1))
    for tokens in (1, 32, 512, 4096):
        assert tuner.choose(tokens) == 2
        tuner.record(tokens, 2, 1.0)


def test_load_moves_it_to_one_thread_fewer_and_back():
    tuner = ThreadTuner((2, 1))
    run(tuner, 20, {2: 1.0, 1: 1.8})
    loaded = run(tuner, 100, {2: 6.0, 1: 1.8})   # other processes took a core
    switched = loaded.index(1)
    assert switched <= 3                          # the slowdown shows within a few steps
    assert loaded[switched + 1:].count(2) <= 100 // tuner.explore_every + 1
    quiet = run(tuner, 2 * tuner.explore_every, {2: 1.0, 1: 1.8})  # the load went away
    back = quiet.index(2)
    assert back <= tuner.explore_every            # the next exploration notices
    assert quiet[back:].count(1) <= 2


def test_loaded_from_the_start_still_finds_the_faster_count():
    tuner = ThreadTuner((2, 1))
    chosen = run(tuner, 3 * tuner.explore_every, {2: 6.0, 1: 1.8})
    first_one = chosen.index(1)
    assert first_one <= tuner.explore_every
    assert chosen[first_one:].count(2) <= 3


def test_one_candidate_is_always_it():
    tuner = ThreadTuner((1,))
    assert set(run(tuner, 50, {1: 1.0})) == {1}
