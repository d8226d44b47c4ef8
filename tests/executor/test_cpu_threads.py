"""ThreadTuner: all cores on a quiet machine, one fewer soon after load
appears, all cores again soon after it goes; neither a shape's first
(kernel-building) step nor noise moves it (simulated step times)."""

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


def test_explorations_that_confirm_all_cores_grow_rarer_and_load_still_shows():
    tuner = ThreadTuner((2, 1))
    steps = 20 * tuner.explore_every
    quiet = run(tuner, steps, {2: 1.0, 1: 1.8})
    # 64, 192, 448, 960 (doubling to quiet_backoff x 64), each first try untimed once: 5 where it was 20
    assert quiet.count(1) <= 6
    loaded = run(tuner, 50, {2: 6.0, 1: 1.8})   # the times show it: no exploration awaited
    assert loaded.index(1) <= 3
    back = run(tuner, 2 * tuner.explore_every, {2: 1.0, 1: 1.8})
    assert back.index(2) <= tuner.explore_every  # on one thread, the preferred is rechecked at the base period


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


def test_a_shapes_first_step_is_not_timed():
    # oneDNN builds kernels the first time it meets a shape: that step is
    # slow on whichever count met it first (two threads: the preferred).
    # Before, that one slow time set off the slowdown rule, one thread was
    # timed on warm kernels, and the class stayed on it until the next
    # exploration.
    tuner = ThreadTuner((2, 1))
    seen: set[int] = set()
    chosen = []
    for i in range(256):
        tokens = 20 + i % 4                        # one size class, four shapes
        t = tuner.choose(tokens)
        first = tokens not in seen
        seen.add(tokens)
        tuner.record(tokens, t, {2: 1.0, 1: 1.6}[t] * (2.5 if first else 1.0))
        chosen.append(t)
    assert chosen.count(1) <= 2 * (256 // tuner.explore_every)  # explorations (and their retries) only


def test_an_untimed_exploration_is_retried_once():
    tuner = ThreadTuner((2, 1))
    chosen = []
    for i in range(3 * tuner.explore_every):      # loaded from the start: one thread is 3x faster
        t = tuner.choose(32)
        tuner.record(32, t, {2: 6.0, 1: 2.0}[t])
        chosen.append(t)
    first_one = chosen.index(1)
    assert chosen[first_one + 1] == 1              # the first (untimed) try is repeated, timed
    assert chosen[first_one + 2:].count(2) <= 3


def test_noise_does_not_move_it_off_every_core():
    # Two threads' times wobble by 20% (other processes' short bursts); one
    # thread is about as fast as their slow steps: not a reason to switch.
    tuner = ThreadTuner((2, 1))
    chosen = []
    for i in range(512):
        t = tuner.choose(32)
        tuner.record(32, t, {2: 1.2 if i % 3 == 0 else 1.0, 1: 1.05}[t])
        chosen.append(t)
    assert chosen.count(1) <= 2 * (512 // tuner.explore_every)


def test_one_candidate_is_always_it():
    tuner = ThreadTuner((1,))
    assert set(run(tuner, 50, {1: 1.0})) == {1}


def test_a_class_compares_counts_per_token():
    # Seen in the online comparison: a class's one loaded step was a large one
    # (232 tokens, 68 ms on two threads, while 31 other requests arrived); its
    # lone 149-token prefills then took 23 ms on two threads and 41 on one.
    # Compared per step, one thread looked faster than two's loaded average
    # and every lone prefill after ran on it.
    tuner = ThreadTuner((2, 1))
    for seconds in (0.407, 0.068):               # the first untimed (a new shape), the second loaded
        assert tuner.choose(232) == 2
        tuner.record(232, 2, seconds)
    chosen = []
    seen: set[int] = set()
    for _ in range(40):
        t = tuner.choose(149)
        tuner.record(149, t, 0.133 if t not in seen else {2: 0.023, 1: 0.041}[t])  # each count's first: a warm-up
        seen.add(t)
        chosen.append(t)
    assert chosen[4:].count(1) == 0, chosen


def test_a_class_that_finds_the_load_gone_sends_the_others_back():
    # Load moved both the decode class (one token a step, every step) and the
    # class of lone prefills (a step per request) to one thread. Once it is
    # gone the decode class finds out within its period; the prefill class,
    # on its own, would run its next 64 requests on one thread first.
    tuner = ThreadTuner((2, 1))
    loaded, quiet = {2: 6.0, 1: 1.8}, {2: 1.0, 1: 1.8}
    prefills = []
    for times in [quiet] * 4 + [loaded] * 12:
        for tokens in (1, 149, 150):                 # each prefill shape's first step on a count is untimed
            t = tuner.choose(tokens)
            tuner.record(tokens, t, times[t] * tokens)
            prefills += [t] if tokens > 1 else []
    assert prefills[-8:] == [1] * 8, prefills
    decode = run(tuner, 2 * tuner.explore_every, quiet, num_tokens=1)   # the load went away
    assert 2 in decode
    prefills = []
    for _ in range(8):
        t = tuner.choose(149)
        tuner.record(149, t, quiet[t] * 149)
        prefills.append(t)
    assert prefills == [2] * 8, prefills


def test_a_fast_step_after_a_slow_one_is_not_a_slowdown():
    # A fresh stack's lone 149-token prefills, traced: the first untimed, the
    # second 36 ms (still warming), the third 23. The average (32) was still
    # above 1.3x the fastest (23) and the next two prefills explored one
    # thread (40 ms each) though the latest step was the fastest yet.
    tuner = ThreadTuner((2, 1))
    chosen = []
    for seconds in (0.028, 0.036, 0.023, 0.024, 0.023, 0.023):
        t = tuner.choose(149)
        tuner.record(149, t, seconds if t == 2 else 0.040)
        chosen.append(t)
    assert chosen == [2] * 6
