"""Unit tests of every consistency model in `strategies/`: events in, decisions out.

The clock is fake (each event carries a plain float `now`); no sockets, no processes, no
sleeping. The simulations below play the coordinator's part: they feed pushes, follow the
Hold and Release decisions, and check the bounds DESIGN.md promises after every event.
"""

import inspect
import math
import random

import pytest

from tensorbus.strategies import (
    STRATEGIES,
    Apply,
    Arrived,
    Async,
    AsyncAveraging,
    Drop,
    DropReason,
    Hold,
    Joined,
    Keep,
    Left,
    OuterOptimizer,
    PeriodicAveraging,
    PushKind,
    Release,
    Rhythm,
    StaleSync,
    Stall,
    Strategy,
    Sync,
    Tick,
    Wait,
)

pytestmark = pytest.mark.timeout(30)

ALL = [Sync, StaleSync, Async, PeriodicAveraging]


def started(strategy, ids):
    """Join `ids` in order (at t=0), checking the start gate on the way; return `strategy`."""
    *gated, last = ids
    for w in gated:
        assert strategy.handle(Joined(w, 0.0)) == [Hold(w)]
        assert not strategy.started
    assert strategy.handle(Joined(last, 0.0)) == [Release(tuple(ids))]
    assert strategy.started
    return strategy


def holds(decisions):
    return [d.worker for d in decisions if isinstance(d, Hold)]


def releases(decisions):
    return [w for d in decisions if isinstance(d, Release) for w in d.workers]


def applies(decisions):
    return [d for d in decisions if isinstance(d, Apply)]


# The start gate (base class, so every model) ----------------------------------------------


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_gate_holds_until_enough_joined_then_releases_in_join_order(cls):
    strategy = cls(workers=4)
    assert not strategy.started
    for w in (7, 3, 5):
        assert strategy.handle(Joined(w, 1.0)) == [Hold(w)]
        assert not strategy.started
    assert strategy.handle(Joined(1, 2.0)) == [Release((7, 3, 5, 1))]
    assert strategy.started
    assert strategy.clocks == {7: 0, 3: 0, 5: 0, 1: 0}
    assert strategy.version == 0


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_gate_of_one_opens_on_the_first_join(cls):
    strategy = cls(workers=1)
    assert strategy.handle(Joined(4, 0.0)) == [Release((4,))]
    assert strategy.started


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_gated_member_that_leaves_is_not_released_and_does_not_count(cls):
    strategy = cls(workers=3)
    assert strategy.handle(Joined(0, 0.0)) == [Hold(0)]
    assert strategy.handle(Joined(1, 1.0)) == [Hold(1)]
    assert strategy.handle(Left(0, 2.0)) == []
    assert strategy.members == {1}
    assert strategy.handle(Joined(2, 3.0)) == [Hold(2)]  # two members: one short still
    assert not strategy.started
    assert strategy.handle(Joined(3, 4.0)) == [Release((1, 2, 3))]
    assert strategy.started


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_gated_member_that_leaves_and_comes_back_is_released_once(cls):
    strategy = cls(workers=3)
    assert strategy.handle(Joined(0, 0.0)) == [Hold(0)]
    assert strategy.handle(Joined(1, 1.0)) == [Hold(1)]
    assert strategy.handle(Left(0, 2.0)) == []
    assert strategy.handle(Joined(0, 3.0)) == [Hold(0)]  # reconnected, holds again
    [release] = strategy.handle(Joined(2, 4.0))
    assert isinstance(release, Release)
    # Each waiting member is answered exactly once: one Ready, one answer.
    assert sorted(release.workers) == [0, 1, 2]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_update_before_the_gate_opens_is_dropped_as_early(cls):
    strategy = cls(workers=2)
    assert strategy.handle(Joined(0, 0.0)) == [Hold(0)]
    assert strategy.handle(Arrived(0, 0, 1.0)) == [Drop(0, 0, DropReason.EARLY)]
    assert strategy.handle(Arrived(5, 0, 1.0)) == [Drop(5, 0, DropReason.NOT_MEMBER)]
    assert strategy.version == 0
    assert strategy.clocks == {0: 0}
    assert strategy.handle(Joined(1, 2.0)) == [Release((0, 1))]
    # The early push was not counted: 0's first real push is kept.
    assert strategy.handle(Arrived(0, 0, 3.0))[0] == Keep(0, 0)
    assert strategy.clocks[0] == 1


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_gate_is_not_reopened_by_a_later_joiner(cls):
    strategy = started(cls(workers=2), [0, 1])
    assert strategy.handle(Joined(2, 1.0)) == []
    assert strategy.handle(Joined(2, 2.0)) == []  # twice is still one member
    assert strategy.members == {0, 1, 2}
    assert strategy.handle(Arrived(2, 0, 3.0))[0] == Keep(2, 0)


def test_late_joiner_starts_at_the_slowest_clock_in_ssp():
    ssp = started(StaleSync(workers=3, staleness=5), [0, 1, 2])
    pushes = {0: 4, 1: 2, 2: 3}
    for w, n in pushes.items():
        for _ in range(n):
            assert Hold(w) not in ssp.handle(Arrived(w, ssp.version, 1.0))
    assert ssp.clocks == pushes
    assert ssp.handle(Joined(9, 2.0)) == []  # no hold: it is not behind the gate
    assert ssp.clocks[9] == 2
    assert ssp.clock_gap() == 2  # it holds nobody back and is not held back
    for _ in range(2):
        assert holds(ssp.handle(Arrived(9, ssp.version, 2.5))) == []
    # The slowest leaves; a joiner now starts level with the new slowest, 2 (at 3).
    assert ssp.handle(Left(1, 3.0)) == []
    assert ssp.handle(Joined(8, 4.0)) == []
    assert ssp.clocks == {0: 4, 2: 3, 9: 4, 8: 3}


def test_late_joiner_in_sync_starts_at_the_slowest_clock():
    sync = started(Sync(workers=3, backups=1), [0, 1, 2])
    for v in range(3):
        assert applies(sync.handle(Arrived(0, v, 1.0))) == []
        assert applies(sync.handle(Arrived(1, v, 1.0))) == [Apply(v, (0, 1))]
    assert sync.clocks == {0: 3, 1: 3, 2: 0}
    assert sync.handle(Joined(5, 2.0)) == []
    assert sync.clocks[5] == 0


# Sync with backups ------------------------------------------------------------------------


def test_first_n_minus_k_make_the_step_in_worker_order():
    sync = started(Sync(workers=4, backups=2), [0, 1, 2, 3])
    assert sync.quorum() == 2
    assert sync.handle(Arrived(3, 0, 1.0)) == [Keep(3, 0)]
    assert sync.handle(Arrived(1, 0, 2.0)) == [Keep(1, 0), Apply(0, (1, 3))]
    assert sync.version == 1
    # The backups' gradients for version 0 are late, then (one version further) stale.
    assert sync.handle(Arrived(0, 0, 3.0)) == [Drop(0, 0, DropReason.LATE)]
    assert sync.handle(Arrived(2, 1, 4.0)) == [Keep(2, 1)]
    assert sync.handle(Arrived(1, 1, 5.0)) == [Keep(1, 1), Apply(1, (1, 2))]
    assert sync.handle(Arrived(0, 1, 6.0)) == [Drop(0, 1, DropReason.LATE)]
    assert sync.handle(Arrived(3, 0, 7.0)) == [Drop(3, 0, DropReason.STALE)]
    assert sync.version == 2
    # A clock counts pushes, taken or dropped late: backups do not fall behind for it.
    assert sync.clocks == {0: 2, 1: 2, 2: 1, 3: 2}


def test_one_backup_makes_every_round_skip_the_slowest():
    sync = started(Sync(workers=3, backups=1), [0, 1, 2])
    for v in range(5):
        assert sync.handle(Arrived(2, v, 10.0 * v)) == [Keep(2, v)]
        assert sync.handle(Arrived(0, v, 10.0 * v + 1)) == [Keep(0, v), Apply(v, (0, 2))]
        assert sync.handle(Arrived(1, v, 10.0 * v + 2)) == [Drop(1, v, DropReason.LATE)]
    assert sync.version == 5


def test_a_member_leaving_shrinks_the_quorum():
    sync = started(Sync(workers=4, backups=1), [0, 1, 2, 3])
    assert sync.quorum() == 3
    assert sync.handle(Arrived(0, 0, 1.0)) == [Keep(0, 0)]
    assert sync.handle(Arrived(1, 0, 2.0)) == [Keep(1, 0)]
    assert sync.handle(Left(3, 3.0)) == [Apply(0, (0, 1))]  # quorum 3 -> 2, and 2 are in
    assert sync.quorum() == 2
    assert sync.handle(Left(2, 4.0)) == []
    assert sync.quorum() == 1  # never below one
    assert sync.handle(Arrived(1, 1, 5.0)) == [Keep(1, 1), Apply(1, (1,))]
    assert sync.handle(Left(1, 6.0)) == []
    assert sync.quorum() == 1


def test_a_pushed_then_left_member_still_counts_toward_the_quorum():
    sync = started(Sync(workers=3, backups=1), [0, 1, 2])
    assert sync.handle(Arrived(0, 0, 1.0)) == [Keep(0, 0)]
    assert sync.handle(Left(0, 2.0)) == []
    assert sync.quorum() == 2  # |{1, 2} ∪ {0}| - 1
    assert sync.handle(Arrived(2, 0, 3.0)) == [Keep(2, 0), Apply(0, (0, 2))]
    assert sync.quorum() == 1


def test_a_joiner_grows_the_quorum():
    sync = started(Sync(workers=2, backups=1), [0, 1])
    assert sync.quorum() == 1
    assert sync.handle(Joined(2, 1.0)) == []
    assert sync.handle(Joined(3, 1.0)) == []
    assert sync.quorum() == 3
    for w in (3, 0):
        assert sync.handle(Arrived(w, 0, 2.0)) == [Keep(w, 0)]
    assert sync.handle(Arrived(2, 0, 3.0)) == [Keep(2, 0), Apply(0, (0, 2, 3))]


@pytest.mark.parametrize(("workers", "backups"), [(1, 1), (3, 3), (3, 4), (3, -1), (1, -5)])
def test_invalid_backups_are_refused(workers, backups):
    with pytest.raises(ValueError, match=rf"^backups must be in 0\.\.workers-1 .*got {backups}$"):
        Sync(workers=workers, backups=backups)


@pytest.mark.parametrize(("workers", "backups"), [(1, 0), (2, 1), (8, 7)])
def test_valid_backups_are_kept(workers, backups):
    sync = Sync(workers=workers, backups=backups)
    assert sync.backups == backups


# StaleSync --------------------------------------------------------------------------------


def test_ssp_staleness_zero_is_lockstep():
    rng = random.Random(3)
    ids = [4, 0, 2, 9]
    ssp = started(StaleSync(workers=4, staleness=0, momentum_correction=False), ids)
    for round_ in range(20):
        order = rng.sample(ids, len(ids))
        *first, last = order
        for w in first:
            version = ssp.version
            assert ssp.handle(Arrived(w, version, float(round_))) == [
                Keep(w, version), Apply(version, (w,)), Hold(w)
            ]
            assert ssp.clock_gap() == 1
        version = ssp.version
        assert ssp.handle(Arrived(last, version, float(round_))) == [
            Keep(last, version), Apply(version, (last,)), Release(tuple(sorted(first)))
        ]
        assert ssp.clock_gap() == 0
        assert set(ssp.clocks.values()) == {round_ + 1}
    assert ssp.version == 80


class Sim:
    """Plays the coordinator and the workers for an ssp/async run on a fake clock.

    A worker takes `period[w]` time units per gradient, computed on the version it had when
    it began. After a push it begins the next gradient at once, unless told to Hold; then
    it begins when Released. Own bookkeeping (clocks, held set) is kept independently of the
    strategy's, so that the strategy's is checked, not trusted.
    """

    def __init__(self, strategy, period):
        self.s = strategy
        self.period = period
        self.clock = dict.fromkeys(period, 0)
        self.held = set()
        self.ready_at = dict(period)
        self.computed_on = dict.fromkeys(period, 0)
        self.holds = {w: 0 for w in period}
        self.max_gap = 0
        self.max_strategy_gap = 0
        self.released_after_start = 0
        self.stalenesses = []

    def step(self, now):
        for w in sorted(self.period):
            if w in self.held or self.ready_at[w] != now:
                continue
            before = self.s.version
            decisions = self.s.handle(Arrived(w, self.computed_on[w], float(now)))
            [apply] = applies(decisions)
            assert decisions[0] == Keep(w, self.computed_on[w])
            assert apply.workers == (w,)
            self.stalenesses.append((before - apply.version, apply.scale))
            assert self.s.version == before + 1
            self.clock[w] += 1
            for r in releases(decisions):
                assert r in self.held
                self.held.discard(r)
                self.released_after_start += 1
                self.begin(r, now)
            for h in holds(decisions):
                assert h == w
                self.held.add(h)
                self.holds[h] += 1
            if w not in self.held:
                self.begin(w, now)
            self.check()

    def begin(self, w, now):
        self.computed_on[w] = self.s.version
        self.ready_at[w] = now + self.period[w]

    def check(self):
        assert self.s.clocks == self.clock
        slowest = min(self.clock.values())
        gap = max(self.clock.values()) - slowest
        self.max_gap = max(self.max_gap, gap)
        self.max_strategy_gap = max(self.max_strategy_gap, self.s.clock_gap())
        assert self.s.clock_gap() == gap
        bound = self.s.staleness
        if bound is not None:
            assert gap <= bound + 1
            for w, c in self.clock.items():
                # Only a held worker may be more than S ahead; it is exactly S + 1 ahead.
                if w in self.held:
                    assert c - slowest == bound + 1
                else:
                    assert c - slowest <= bound


@pytest.mark.parametrize("fast", [1, 2, 3])
def test_ssp_bounds_clock_gaps_with_a_straggler(fast):
    staleness = 2
    period = {w: 1 for w in range(fast)} | {fast: 3}  # one push per 3 of each fast worker
    ssp = started(StaleSync(workers=fast + 1, staleness=staleness), sorted(period))
    sim = Sim(ssp, period)
    for now in range(1, 301):
        sim.step(now)
    assert sim.max_gap == staleness + 1
    assert sim.max_strategy_gap == staleness + 1
    assert all(sim.holds[w] > 10 for w in range(fast))  # fast workers do get held
    assert sim.holds[fast] == 0  # the straggler never is
    assert sim.released_after_start == sum(sim.holds.values()) - len(sim.held)
    # The straggler sets the pace: nobody runs more than S + 1 pushes ahead of it.
    assert sim.clock[fast] == 100
    assert all(sim.clock[fast] <= sim.clock[w] <= sim.clock[fast] + staleness + 1
               for w in range(fast))


def test_async_never_holds_after_the_start():
    period = {0: 1, 1: 1, 2: 6}
    strategy = started(Async(workers=3), [0, 1, 2])
    sim = Sim(strategy, period)
    for now in range(1, 301):
        sim.step(now)
    assert sum(sim.holds.values()) == 0
    assert sim.released_after_start == 0
    assert sim.clock == {0: 300, 1: 300, 2: 50}
    assert strategy.clock_gap() == 250  # no bound at all
    # The straggler's gradients are stale: two fast pushes a time unit, six units each.
    assert max(s for s, _ in sim.stalenesses) == 12


@pytest.mark.parametrize("cls", [StaleSync, Async], ids=lambda c: c.name)
def test_staleness_in_apply_and_its_damping(cls):
    kwargs = {"staleness": 10} if cls is StaleSync else {}
    period = {0: 1, 1: 1, 2: 4}
    for damped in (False, True):
        strategy = started(cls(workers=3, staleness_lr=damped, momentum_correction=False,
                               **kwargs), [0, 1, 2])
        sim = Sim(strategy, period)
        for now in range(1, 101):
            sim.step(now)
        stalenesses = {s for s, _ in sim.stalenesses}
        assert {0, 8} <= stalenesses  # fresh ones and the straggler's (2 a unit, for 4)
        for s, scale in sim.stalenesses:
            assert scale == (1.0 / (1 + s) if damped else 1.0)


@pytest.mark.parametrize("cls", [StaleSync, Async], ids=lambda c: c.name)
def test_momentum_correction_scales_each_gradient_and_lowers_the_momentum(cls):
    """On by default: W workers' stale pushes add a momentum of about 1 - 1/W (Mitliagkas et
    al. 2016), taken off the optimizer's; each gradient counts 1/W, as in sync's average."""
    strategy = started(cls(workers=4), [0, 1, 2, 3])
    assert strategy.handle(Arrived(0, 0, 1.0))[1] == Apply(0, (0,), 1 / 4)
    assert strategy.corrected_momentum(0.9) == pytest.approx(0.15)
    assert strategy.corrected_momentum(0.5) == 0.0  # (never below none)
    damped = started(cls(workers=4, staleness_lr=True), [0, 1, 2, 3])
    damped.handle(Arrived(0, 0, 1.0))
    assert damped.handle(Arrived(1, 0, 1.0))[1] == Apply(0, (1,), 1 / 2 / 4)  # both
    off = started(cls(workers=4, momentum_correction=False), [0, 1, 2, 3])
    assert off.handle(Arrived(0, 0, 1.0))[1] == Apply(0, (0,), 1.0)
    assert off.corrected_momentum(0.9) == 0.9
    assert Sync(workers=4).corrected_momentum(0.9) == 0.9


def test_staleness_is_the_versions_applied_since_the_gradient_was_computed():
    ssp = started(StaleSync(workers=2, staleness=None, staleness_lr=True,
                            momentum_correction=False), [0, 1])
    for v in range(4):
        assert ssp.handle(Arrived(0, v, 1.0)) == [Keep(0, v), Apply(v, (0,), 1.0)]
    assert ssp.handle(Arrived(1, 0, 2.0)) == [Keep(1, 0), Apply(0, (1,), 1 / 5)]
    assert ssp.handle(Arrived(1, 3, 3.0)) == [Keep(1, 3), Apply(3, (1,), 1 / 3)]
    assert ssp.handle(Arrived(1, 6, 4.0)) == [Keep(1, 6), Apply(6, (1,), 1.0)]
    assert ssp.handle(Arrived(1, 8, 5.0)) == [Drop(1, 8, DropReason.AHEAD)]
    assert ssp.version == 7


def test_ssp_left_of_the_straggler_releases_the_held_workers():
    ssp = started(StaleSync(workers=3, staleness=1), [0, 1, 2])
    assert holds(ssp.handle(Arrived(0, 0, 1.0))) == []  # 1 ahead: within S
    assert holds(ssp.handle(Arrived(1, 1, 1.0))) == []
    assert holds(ssp.handle(Arrived(0, 2, 2.0))) == [0]
    assert holds(ssp.handle(Arrived(1, 3, 2.0))) == [1]
    assert ssp.clock_gap() == 2
    assert ssp.handle(Left(2, 3.0)) == [Release((0, 1))]
    assert ssp.clock_gap() == 0
    # Released, they go on: each may push again.
    assert holds(ssp.handle(Arrived(0, 4, 4.0))) == []


def test_ssp_left_of_another_member_releases_nobody():
    ssp = started(StaleSync(workers=3, staleness=0, momentum_correction=False), [0, 1, 2])
    assert holds(ssp.handle(Arrived(0, 0, 1.0))) == [0]
    assert ssp.handle(Left(1, 2.0)) == []  # 2 is still at 0
    assert ssp.handle(Arrived(2, 1, 3.0)) == [Keep(2, 1), Apply(1, (2,)), Release((0,))]


def test_ssp_left_of_one_of_two_slowest_releases_nobody():
    ssp = started(StaleSync(workers=3, staleness=0), [0, 1, 2])
    assert holds(ssp.handle(Arrived(0, 0, 1.0))) == [0]
    assert ssp.handle(Left(2, 2.0)) == []  # 1 is at 0 still
    assert ssp.handle(Left(1, 3.0)) == [Release((0,))]


def test_ssp_left_of_a_held_worker_drops_its_hold():
    ssp = started(StaleSync(workers=2, staleness=0, stall_after_s=5.0, momentum_correction=False), [0, 1])
    assert holds(ssp.handle(Arrived(0, 0, 1.0))) == [0]
    assert ssp.handle(Left(0, 2.0)) == []
    assert ssp.handle(Tick(100.0)) == []  # nobody held: nothing to report
    assert ssp.handle(Arrived(1, 1, 3.0)) == [Keep(1, 1), Apply(1, (1,))]


def test_ssp_held_worker_pushing_again_is_a_duplicate():
    ssp = started(StaleSync(workers=2, staleness=0), [0, 1])
    assert holds(ssp.handle(Arrived(0, 0, 1.0))) == [0]
    assert ssp.handle(Arrived(0, 1, 2.0)) == [Drop(0, 1, DropReason.DUPLICATE)]
    assert ssp.handle(Arrived(0, 0, 2.0)) == [Drop(0, 0, DropReason.DUPLICATE)]
    assert ssp.version == 1
    assert ssp.clocks == {0: 1, 1: 0}
    assert releases(ssp.handle(Arrived(1, 0, 3.0))) == [0]
    assert ssp.handle(Arrived(0, 2, 4.0))[0] == Keep(0, 2)  # released: taken again


@pytest.mark.parametrize("staleness", [-1, -10])
def test_ssp_invalid_staleness(staleness):
    with pytest.raises(ValueError, match=rf"^staleness must be at least 0, got {staleness}$"):
        StaleSync(workers=2, staleness=staleness)


def test_ssp_rejects_updates_no_model_may_take():
    ssp = started(StaleSync(workers=2), [0, 1])
    assert ssp.handle(Arrived(0, 1, 1.0)) == [Drop(0, 1, DropReason.AHEAD)]
    assert ssp.handle(Arrived(7, 0, 1.0)) == [Drop(7, 0, DropReason.NOT_MEMBER)]
    assert ssp.version == 0
    assert ssp.clocks == {0: 0, 1: 0}


def test_async_is_unbounded_ssp():
    strategy = Async(workers=3)
    assert strategy.staleness is None
    assert isinstance(strategy, StaleSync)
    assert not strategy.staleness_lr
    assert Async(workers=1, staleness_lr=True).staleness_lr


# Stall in ssp -----------------------------------------------------------------------------


def test_ssp_stall_is_reported_once_a_period_for_a_held_worker():
    ssp = started(StaleSync(workers=3, staleness=0, stall_after_s=10.0), [0, 1, 2])
    assert holds(ssp.handle(Arrived(0, 0, 100.0))) == [0]
    assert ssp.handle(Tick(100.0)) == []
    assert ssp.handle(Tick(109.5)) == []
    assert ssp.handle(Tick(110.0)) == [Stall(1, (1, 2), 10.0)]  # waiting for the slowest
    assert ssp.handle(Tick(110.0)) == []
    assert ssp.handle(Tick(119.0)) == []
    assert holds(ssp.handle(Arrived(1, 1, 119.5))) == [1]
    assert ssp.handle(Tick(120.0)) == [Stall(2, (2,), 20.0)]  # 1 held only 0.5 s
    assert ssp.handle(Tick(129.5)) == [Stall(2, (2,), 10.0)]  # now 1's period is up
    assert ssp.handle(Tick(131.0)) == [Stall(2, (2,), 31.0)]
    assert ssp.handle(Tick(139.0)) == []
    assert releases(ssp.handle(Arrived(2, 2, 140.0))) == [0, 1]
    assert ssp.handle(Tick(1000.0)) == []  # nobody held


def test_ssp_stall_period_restarts_with_each_hold():
    ssp = started(StaleSync(workers=2, staleness=0, stall_after_s=10.0), [0, 1])
    assert holds(ssp.handle(Arrived(0, 0, 0.0))) == [0]
    assert ssp.handle(Tick(35.0)) == [Stall(1, (1,), 35.0)]
    assert releases(ssp.handle(Arrived(1, 0, 36.0))) == [0]
    assert holds(ssp.handle(Arrived(0, 2, 40.0))) == [0]
    assert ssp.handle(Tick(49.0)) == []
    assert ssp.handle(Tick(50.0)) == [Stall(3, (1,), 10.0)]


def test_ssp_stall_period_restarts_for_a_worker_that_left_and_came_back():
    ssp = started(StaleSync(workers=2, staleness=0, stall_after_s=10.0), [0, 1])
    assert holds(ssp.handle(Arrived(0, 0, 0.0))) == [0]
    assert ssp.handle(Tick(30.0)) == [Stall(1, (1,), 30.0)]
    assert ssp.handle(Left(0, 35.0)) == []  # timed out while held
    assert ssp.handle(Joined(0, 36.0)) == []  # reconnects; starts level with 1
    assert holds(ssp.handle(Arrived(0, 1, 40.0))) == [0]
    # A new hold, so a new period: the old hold's 30 s must not delay this report.
    assert ssp.handle(Tick(50.0)) == [Stall(2, (1,), 10.0)]


def test_no_stall_in_async():
    strategy = started(Async(workers=2, stall_after_s=1.0), [0, 1])
    for v in range(20):
        assert holds(strategy.handle(Arrived(0, v, float(v)))) == []
    assert strategy.handle(Tick(1e6)) == []


@pytest.mark.parametrize("cls", [StaleSync, Async], ids=lambda c: c.name)
def test_ssp_tick_before_anyone_joined(cls):
    assert cls(workers=2).handle(Tick(1e9)) == []


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "event", [None, "tick", (0, 0, 0.0), Keep(0, 0), Hold(0), Tick],
    ids=["none", "str", "tuple", "keep", "hold", "class"],
)
def test_not_an_event(cls, event):
    strategy = cls(workers=1)
    with pytest.raises(TypeError, match="not a strategy event"):
        strategy.handle(event)


# PeriodicAveraging ------------------------------------------------------------------------


@pytest.mark.parametrize("every", [1, 4, 100])
def test_average_rhythm(every):
    avg = PeriodicAveraging(workers=2, average_every=every)
    assert avg.rhythm == Rhythm(push=PushKind.WEIGHTS, local_steps=every, wait=Wait.NEWER)
    assert avg.average_every == every
    assert avg.outer is None
    assert avg.backups == 0


def test_rhythm_is_per_instance():
    a = PeriodicAveraging(workers=2, average_every=3)
    b = PeriodicAveraging(workers=2, average_every=5)
    assert (a.rhythm.local_steps, b.rhythm.local_steps) == (3, 5)
    for cls in (Strategy, *ALL):
        assert "rhythm" not in vars(cls)


@pytest.mark.parametrize(
    ("cls", "rhythm"),
    [
        (Sync, Rhythm(push=PushKind.GRADIENT, local_steps=1, wait=Wait.NEWER)),
        (StaleSync, Rhythm(push=PushKind.GRADIENT, local_steps=1, wait=Wait.ANSWERED)),
        (Async, Rhythm(push=PushKind.GRADIENT, local_steps=1, wait=Wait.NOTHING)),
        (PeriodicAveraging, Rhythm(push=PushKind.WEIGHTS, local_steps=8, wait=Wait.NEWER)),
    ],
    ids=["sync", "ssp", "async", "average"],
)
def test_default_rhythms(cls, rhythm):
    assert cls(workers=3).rhythm == rhythm


def test_unbounded_ssp_has_the_async_rhythm():
    assert StaleSync(workers=2, staleness=None).rhythm == Async(workers=2).rhythm
    assert StaleSync(workers=2, staleness=0).rhythm.wait is Wait.ANSWERED


@pytest.mark.parametrize("every", [0, -3])
def test_average_every_is_refused_below_one(every):
    with pytest.raises(ValueError, match=rf"^average_every must be at least 1, got {every}$"):
        PeriodicAveraging(workers=2, average_every=every)


def test_outer_optimizer_is_built_from_the_options():
    avg = PeriodicAveraging(workers=2, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    assert avg.outer == OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    assert PeriodicAveraging(workers=2, outer_lr=1.0).outer == OuterOptimizer(lr=1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"outer_lr": 0.0}, "outer_lr must be positive"),
        ({"outer_lr": -1.0}, "outer_lr must be positive"),
        ({"outer_lr": math.nan}, "outer_lr must be positive"),
        ({"outer_lr": 0.5, "outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\)"),
        ({"outer_lr": 0.5, "outer_momentum": -0.1}, r"outer_momentum must be in \[0, 1\)"),
        ({"outer_lr": 0.5, "outer_momentum": math.nan}, r"outer_momentum must be in \[0, 1\)"),
        ({"outer_lr": 0.5, "nesterov": True}, "nesterov needs outer_momentum above 0"),
        ({"outer_momentum": 0.9}, "outer_momentum or nesterov needs outer_lr"),
        ({"nesterov": True}, "outer_momentum or nesterov needs outer_lr"),
    ],
)
def test_invalid_outer_optimizer(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PeriodicAveraging(workers=2, **kwargs)


def test_outer_optimizer_validates_on_its_own():
    with pytest.raises(ValueError, match="outer_lr"):
        OuterOptimizer(lr=0.0)
    with pytest.raises(ValueError, match="nesterov"):
        OuterOptimizer(lr=1.0, nesterov=True)
    assert OuterOptimizer(lr=1.0) == OuterOptimizer(lr=1.0, momentum=0.0, nesterov=False)


def test_fragments_push_one_every_h_over_p_steps_in_turn_without_waiting():
    avg = PeriodicAveraging(workers=2, average_every=12, fragments=3, fragment_mix=0.25)
    assert avg.rhythm == Rhythm(push=PushKind.WEIGHTS, local_steps=4, wait=Wait.OVERLAPPED,
                                fragments=3, mix=0.25)
    assert [avg.rhythm.fragment(v) for v in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert PeriodicAveraging(workers=2, average_every=4, fragments=2).rhythm.mix == 0.5
    assert PeriodicAveraging(workers=2).rhythm.fragment(5) == -1  # the whole model


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"average_every": 8, "fragments": 0}, r"fragments must be in 1\.\.average_every \(8\)"),
        ({"average_every": 4, "fragments": 8}, r"fragments must be in 1\.\.average_every \(4\)"),
        ({"average_every": 8, "fragments": 3}, r"average_every \(8\) must be a multiple of "
                                               r"fragments \(3\)"),
        ({"fragment_mix": 0.5}, "fragment_mix needs fragments"),
        ({"fragments": 2, "fragment_mix": 1.0}, r"fragment_mix must be in \[0, 1\)"),
        ({"fragments": 2, "fragment_mix": -0.1}, r"fragment_mix must be in \[0, 1\)"),
        ({"fragments": 2, "fragment_mix": math.nan}, r"fragment_mix must be in \[0, 1\)"),
    ],
)
def test_invalid_fragments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PeriodicAveraging(workers=2, **kwargs)


def test_streamed_rounds_are_sync_rounds():
    """A version is one fragment's average: the barrier is sync's all the same."""
    rng = random.Random(3)
    events = [Joined(w, 0.0) for w in range(3)] + random_events(rng, 3, 300)
    streamed = PeriodicAveraging(workers=3, average_every=4, fragments=2, stall_after_s=20.0)
    assert play(streamed, events) == play(Sync(workers=3, stall_after_s=20.0), events)


def random_events(rng, n, count):
    """A plausible coordinator's event stream: joins, pushes (fresh, late, ahead, foreign),
    leaves and ticks, with `now` increasing."""
    now = 0.0
    events = []
    ranks = list(range(n + 2))
    for _ in range(count):
        now += rng.random()
        w = rng.choice(ranks)
        r = rng.random()
        if r < 0.08:
            events.append(Joined(w, now))
        elif r < 0.12:
            events.append(Left(w, now))
        elif r < 0.2:
            events.append(Tick(now + rng.random() * 60))
        else:
            events.append(("push", w, rng.choice([0, 0, 0, -1, -2, 1]), now))
    return events


def play(strategy, events):
    out = []
    for e in events:
        if isinstance(e, tuple):  # a push on the strategy's version, plus an offset
            _, w, offset, now = e
            e = Arrived(w, max(0, strategy.version + offset), now)
        out.append((e, strategy.handle(e)))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_average_rounds_equal_sync_rounds(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    events = [Joined(w, 0.0) for w in rng.sample(range(n + 2), n)] + random_events(rng, n, 400)
    sync = Sync(workers=n, stall_after_s=20.0)
    avg = PeriodicAveraging(workers=n, average_every=rng.randint(1, 9), stall_after_s=20.0)
    played = play(avg, events)
    assert played == play(sync, events)
    assert avg.version == sync.version
    assert avg.version > 5  # the stream did build versions
    kinds = {type(d) for _, ds in played for d in ds}
    assert {Keep, Apply, Drop, Hold, Release, Stall} <= kinds


# Registry and options ---------------------------------------------------------------------


def test_registry_names():
    assert STRATEGIES == {
        "sync": Sync, "ssp": StaleSync, "async": Async, "average": PeriodicAveraging,
        "async-average": AsyncAveraging,
    }
    for name, cls in STRATEGIES.items():
        assert cls.name == name


BASE = set(inspect.signature(Strategy.__init__).parameters) - {"self"}


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_options_match_the_keyword_arguments(cls):
    params = inspect.signature(cls.__init__).parameters
    kwargs = {name: p for name, p in params.items() if name != "self"}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in kwargs.values())
    assert isinstance(cls.options, frozenset)
    assert cls.options == set(kwargs) - BASE
    assert "workers" in kwargs and kwargs["workers"].default is inspect.Parameter.empty
    # Every option has a default, so a launcher may pass only those the user gave.
    defaults = {name: kwargs[name].default for name in cls.options}
    assert inspect.Parameter.empty not in defaults.values()
    strategy = cls(workers=2, **defaults)
    assert strategy.workers == 2


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_options_of_another_model_are_refused(cls):
    others = set().union(*(c.options for c in ALL)) - cls.options
    assert others
    for option in sorted(others):
        with pytest.raises(TypeError, match=option):
            cls(workers=2, **{option: 1})


def test_options_per_model():
    assert Sync.options == {"backups"}
    assert StaleSync.options == {"staleness", "staleness_lr", "momentum_correction"}
    assert Async.options == {"staleness_lr", "momentum_correction"}
    assert PeriodicAveraging.options == {"average_every", "outer_lr", "outer_momentum", "nesterov",
                                         "fragments", "fragment_mix"}


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
@pytest.mark.parametrize("workers", [0, -2])
def test_invalid_workers(cls, workers):
    with pytest.raises(ValueError, match=rf"^workers must be at least 1, got {workers}$"):
        cls(workers=workers)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan])
def test_invalid_stall_after(cls, seconds):
    with pytest.raises(ValueError, match="stall_after_s must be positive"):
        cls(workers=1, stall_after_s=seconds)


def test_async_average_applies_each_change_at_one_over_w_and_holds_nobody():
    strategy = AsyncAveraging(workers=2, average_every=4)
    assert strategy.rhythm == Rhythm(push=PushKind.WEIGHTS, local_steps=4, wait=Wait.ANSWERED)
    assert strategy.changes_pushed and not Sync(workers=2).changes_pushed
    for worker in (0, 1):
        strategy.handle(Joined(worker, 0.0))
    # Worker 0 three times before worker 1 once: each a version of its own, none held.
    decisions = [strategy.handle(Arrived(w, v, 0.0)) for w, v in ((0, 0), (0, 1), (0, 2), (1, 0))]
    assert [d for ds in decisions for d in ds if isinstance(d, Apply)] == [
        Apply(0, (0,), 0.5), Apply(1, (0,), 0.5), Apply(2, (0,), 0.5), Apply(0, (1,), 0.5)]
    assert not any(isinstance(d, Hold) for ds in decisions for d in ds)
    assert strategy.version == 4
    with pytest.raises(ValueError, match="average_every must be at least 1, got 0"):
        AsyncAveraging(workers=2, average_every=0)


def test_async_average_delays_its_nesterov_momentum_over_n_changes_each_at_one_over_n():
    strategy = AsyncAveraging(workers=4, outer_lr=0.7, outer_momentum=0.9, momentum_every=2)
    assert strategy.outer == OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True, every=2)
    assert strategy.corrected_momentum(0.9) == 0.9  # delayed, not lowered
    strategy.handle(Joined(0, 0.0))
    for worker in (1, 2, 3):
        strategy.handle(Joined(worker, 0.0))
    assert [d for d in strategy.handle(Arrived(0, 0, 0.0)) if isinstance(d, Apply)] == [
        Apply(0, (0,), 0.5)]
    # N is the number of workers unless given; without momentum there is nothing to delay.
    assert AsyncAveraging(workers=4, outer_lr=0.7, outer_momentum=0.9).outer.every == 4
    assert AsyncAveraging(workers=4, outer_lr=0.7).outer == OuterOptimizer(lr=0.7)
    assert AsyncAveraging(workers=4).outer is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"outer_momentum": 0.9}, "outer_momentum needs outer_lr"),
    ({"outer_lr": 0.7, "momentum_every": 2}, "momentum_every delays Nesterov momentum: it "
                                             "needs outer_momentum"),
    ({"outer_lr": 0.7, "outer_momentum": 0.9, "momentum_every": 0},
     "momentum_every must be at least 1, got 0"),
])
def test_async_average_refuses_an_outer_optimizer_it_cannot_take(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncAveraging(workers=2, **kwargs)


def test_dynamic_steps_scale_each_worker_s_h_to_its_speed_over_the_fastest():
    strategy = AsyncAveraging(workers=3, average_every=8, dynamic_steps=True)
    for worker in range(3):
        strategy.handle(Joined(worker, 0.0))
    assert strategy.local_steps(0) == 8  # no speed known yet: H
    strategy.handle(Arrived(0, 0, 0.0, speed=1000.0))
    strategy.handle(Arrived(1, 0, 0.0, speed=300.0))
    strategy.handle(Arrived(2, 0, 0.0, speed=10.0))
    assert [strategy.local_steps(w) for w in range(3)] == [8, 2, 1]  # 8 x 0.3, at least 1
    strategy.handle(Arrived(1, 1, 0.0, speed=700.0))  # half of each new measure counts
    assert strategy.local_steps(1) == 4  # 8 x 500 / 1000
    strategy.handle(Left(0, 1.0))  # the fastest left: worker 1 is the fastest now
    assert [strategy.local_steps(w) for w in (1, 2)] == [8, 1]
    assert AsyncAveraging(workers=3).local_steps(0) is None  # off: the rhythm's H for all
    assert Sync(workers=2).local_steps(0) is None
