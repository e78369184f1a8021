"""The contention measurement of layout: auto in several windows (auto.together_windows,
auto.slowdown_windows, auto.effective_cores): a fixed fake clock, no sleeps, no MPI."""
import pytest

from hgsgc.hourglass import auto


class FakeClock:
    """A clock that only moves when the timed work 'runs': each call of ``work`` advances it by
    the next scripted duration."""

    def __init__(self, durations):
        self.t = 100.0
        self.durations = list(durations)
        self.calls = 0

    def __call__(self):
        return self.t

    def work(self):
        self.t += self.durations[self.calls]
        self.calls += 1


class Comm:
    def __init__(self):
        self.barriers = 0

    def Barrier(self):
        self.barriers += 1


def test_windows_are_medians_of_their_calls_and_spaced():
    # 3 windows x (1 untimed + 3 timed calls); the untimed call of each window is 99 s (ignored)
    script = [99, 1.0, 3.0, 2.0,   99, 5.0, 4.0, 6.0,   99, 0.5, 0.5, 9.0]
    clock, comm, slept = FakeClock(script), Comm(), []
    got = auto.together_windows(comm, clock.work, windows=3, repeats=3, gap_s=0.25, clock=clock, sleep=slept.append)
    assert got == [2.0, 5.0, 0.5]
    assert comm.barriers == 3 and slept == [0.25, 0.25] and clock.calls == 12
    with pytest.raises(ValueError, match="windows=0"):
        auto.together_windows(comm, clock.work, windows=0)


def test_a_spike_in_one_window_does_not_move_the_median():
    # machine 0: ranks 0, 1 (alone 1.0 s, 2.0 s); machine 1: rank 2 (alone 1.0 s). 5 windows;
    # window 3 is a load spike on machine 0 (12x), window 0 a smaller one (4x)
    machine_of = [0, 0, 1]
    alone = [1.0, 2.0, 1.0]
    together = [[4.0, 3.0, 3.2, 12.0, 2.9],
                [8.2, 6.0, 6.0, 24.0, 6.2],
                [1.0, 1.1, 0.9, 1.0, 1.0]]
    sw = auto.slowdown_windows(machine_of, alone, together)
    # per window: median over the machine's ranks of together / alone (2 ranks: their mean)
    assert sw["per_window"][0] == pytest.approx([4.05, 3.0, 3.1, 12.0, 3.0], rel=1e-12)
    assert sw["per_window"][1] == pytest.approx([1.0, 1.1, 0.9, 1.0, 1.0], rel=1e-12)
    assert sw["median"] == pytest.approx([3.1, 1.0], rel=1e-12)        # the spikes are ignored
    assert sw["min"] == pytest.approx([3.0, 0.9]) and sw["max"] == pytest.approx([12.0, 1.1])
    assert sw["spread"] == pytest.approx([4.0, 1.1 / 0.9], rel=1e-12)
    # the mean would have been 5.03: the one-window measurement of session 5 could have been 12
    cores, slow = auto.effective_cores(machine_of, [2.0, 4.0], alone, together, 1.0)
    assert slow == pytest.approx([3.1, 1.0], rel=1e-12)
    assert cores == pytest.approx([1.0 * 2 / 3.1, 4.0], rel=1e-12)      # P = u k / s_m; no contention: affinity


def test_one_window_per_rank_is_the_old_measurement():
    # a float per rank is one window: the session-5 behaviour (median over ranks of the ratio)
    cores, slow = auto.effective_cores([0, 0, 0, 1], [2.0, 4.0], [1.0, 2.0, 1.0, 1.0], [2.0, 6.0, 2.5, 0.9], 0.9)
    assert slow == pytest.approx([2.5, 0.9]) and cores == pytest.approx([1.08, 4.0])
    with pytest.raises(ValueError, match="alone seconds > 0"):
        auto.slowdown_windows([0], [0.0], [[1.0]])
