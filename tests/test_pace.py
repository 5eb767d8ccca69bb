"""The Pacer's decisions (hsdp/sync/pace.py) on a fake clock: which nominal steps of a period a replica trains."""

from __future__ import annotations

from hsdp.config.schema import SyncConfig
from hsdp.sync.pace import Pacer


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _pacer(clock: Clock, **sync) -> Pacer:
    cfg = SyncConfig(**{"warmup_steps": 0, "every": 8, "every_s": 1.0, **sync})
    return Pacer(cfg, steps=20, agree=lambda late: late, clock=clock)  # rounds after steps 7 and 15


def _period(p: Pacer, clock: Clock, first: int, step_s: float, last: list, n: int = 8) -> list[int]:
    """Run n nominal steps (a period) at `step_s` a step; the trained steps (the last one's time in `last`)."""
    trained = []
    for step in range(first, first + n):
        if not p.cut(step, last[0]):
            trained.append(step)
            clock.t += step_s
            last[0] = step_s
        else:
            last[0] = None
        clock.t += 0.001  # the loop's own time between steps
        p.met(step)
    return trained


def test_a_period_trains_the_steps_that_end_within_its_window() -> None:
    clock, last = Clock(), [None]
    p = _pacer(clock)
    assert _period(p, clock, 0, 0.3, last) == [0, 1, 2]  # the window starts with the loop: 3 × 0.3 s fit in 1 s
    assert _period(p, clock, 8, 0.3, last) == [8, 9, 10]
    assert _period(p, clock, 16, 0.3, last, n=4) == [16, 17, 18, 19]  # past the last round: the tail trains all
    assert p.periods == [3, 3] and p.cut_steps == 10
    assert p.position(16) == 16 - 10  # the data stream's position: the steps trained before


def test_every_period_trains_its_first_step_and_fragments_share_the_window() -> None:
    clock, last = Clock(), [None]
    p = _pacer(clock)
    # The run's first step (a compile) is not the pace: the first period times its second step too.
    assert _period(p, clock, 0, 2.0, last) == [0, 1]
    assert _period(p, clock, 8, 2.0, last) == [8]  # longer than the window: still one step a period
    q = _pacer(Clock(), fragments=2)
    assert q.window_s == 0.5  # each fragment's slot: H/P nominal steps, every_s/P seconds


def test_a_slow_first_step_does_not_starve_the_first_window() -> None:
    """A 30 s first step (a cold compile) among 0.1 s steps: the first 1 s window still trains its steps."""
    clock, last = Clock(), [None]
    p = _pacer(clock)
    trained = []
    for step in range(8):
        if not p.cut(step, last[0]):
            trained.append(step)
            clock.t += 30.0 if step == 0 else 0.1
            last[0] = 30.0 if step == 0 else 0.1
        else:
            last[0] = None
        p.met(step)
    assert len(trained) > 1, trained
    assert p.state_dict()["first_trained"] is False


def test_the_warmup_is_never_cut_and_a_restore_keeps_the_position() -> None:
    clock, _last = Clock(), [None]
    cfg = SyncConfig(warmup_steps=4, every=8, every_s=0.1)
    p = Pacer(cfg, steps=20, agree=lambda late: late, clock=clock)
    for step in range(4):  # grad-sync steps: lockstep rounds, each trained whatever it takes
        assert not p.cut(step, 5.0)
        clock.t += 5.0
        p.met(step)
    assert p.met_at == clock.t  # the warmup's last step began the first window
    assert not p.cut(4, 5.0)  # the warmup step's time (it waited for every replica) is not an estimate
    r = Pacer(cfg, steps=20, agree=lambda late: late, clock=clock)
    r.load_state_dict({"cut_steps": 3, "periods": [5]})
    assert r.position(12) == 9 and r.stats() == {"paced_cut_steps": 3, "paced_period_steps": [5]}
