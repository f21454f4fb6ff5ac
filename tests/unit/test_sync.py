"""Unit tests of the synchronous strategy (`strategies.sync.Sync`): events in, decisions out.

The clock is fake: each event carries a plain float `now`. No I/O, no sleeping.
"""

import itertools
import math

import pytest

from tensorbus.strategies import (
    Apply,
    Arrived,
    Drop,
    DropReason,
    Hold,
    Joined,
    Keep,
    Left,
    PushKind,
    Release,
    Rhythm,
    Stall,
    Sync,
    Tick,
    Wait,
)

pytestmark = pytest.mark.timeout(30)


def started(workers, ids=None, *, stall_after_s=30.0):
    """A Sync whose members `ids` (default 0..workers-1) have all joined at t=0.

    Every joiner but the last is held at the start gate; the last opens it and releases
    them all, in join order.
    """
    sync = Sync(workers=workers, stall_after_s=stall_after_s)
    ids = list(range(workers)) if ids is None else list(ids)
    assert len(ids) == workers
    *gated, last = ids
    for w in gated:
        assert sync.handle(Joined(w, 0.0)) == [Hold(w)]
        assert not sync.started
    assert sync.handle(Joined(last, 0.0)) == [Release(tuple(ids))]
    assert sync.started
    return sync


def run_round(sync, workers, now=1.0):
    """Every worker pushes for the current version; returns the Apply."""
    version = sync.version
    *first, last = workers
    for w in first:
        assert sync.handle(Arrived(w, version, now)) == [Keep(w, version)]
    decisions = sync.handle(Arrived(last, version, now))
    assert decisions[0] == Keep(last, version)
    assert len(decisions) == 2
    return decisions[1]


def test_name_and_rhythm():
    assert Sync.name == "sync"
    assert Sync(workers=2).rhythm == Rhythm(push=PushKind.GRADIENT, local_steps=1, wait=Wait.NEWER)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_one_apply_per_round_on_the_last_arrival(n):
    ids = [7, 3, 5, 1][:n]
    sync = started(n, ids)
    assert sync.version == 0
    for round_ in range(3):
        for i, w in enumerate(ids):
            decisions = sync.handle(Arrived(w, round_, 10.0 * round_ + i))
            if i < n - 1:
                assert decisions == [Keep(w, round_)]
                assert sync.version == round_
            else:
                assert decisions == [Keep(w, round_), Apply(round_, tuple(sorted(ids)))]
        assert sync.version == round_ + 1


def test_version_set_on_resume_is_the_one_built():
    sync = started(1)
    sync.version = 41  # as a coordinator resuming from a checkpoint sets it
    assert sync.handle(Arrived(0, 41, 1.0)) == [Keep(0, 41), Apply(41, (0,))]
    assert sync.version == 42
    assert sync.handle(Arrived(0, 40, 2.0)) == [Drop(0, 40, DropReason.STALE)]


def test_start_gate_waits_for_the_configured_workers():
    sync = Sync(workers=3)
    assert sync.handle(Joined(0, 0.0)) == [Hold(0)]
    assert sync.handle(Joined(1, 0.5)) == [Hold(1)]
    assert not sync.started
    # Nobody was released yet, so anything pushed now is early.
    assert sync.handle(Arrived(0, 0, 1.0)) == [Drop(0, 0, DropReason.EARLY)]
    assert sync.handle(Arrived(1, 0, 2.0)) == [Drop(1, 0, DropReason.EARLY)]
    assert sync.version == 0
    assert sync.handle(Joined(2, 3.0)) == [Release((0, 1, 2))]
    assert sync.started
    assert sync.version == 0
    assert sync.handle(Arrived(1, 0, 4.0)) == [Keep(1, 0)]  # the early push did not count
    assert sync.handle(Arrived(0, 0, 4.0)) == [Keep(0, 0)]
    assert sync.handle(Arrived(2, 0, 4.0)) == [Keep(2, 0), Apply(0, (0, 1, 2))]
    assert sync.version == 1


def test_start_gate_is_not_opened_by_a_leave():
    sync = Sync(workers=3)
    assert sync.handle(Joined(0, 0.0)) == [Hold(0)]
    assert sync.handle(Joined(1, 1.0)) == [Hold(1)]
    assert sync.handle(Left(1, 2.0)) == []  # 0 alone must not train by itself
    assert not sync.started
    assert sync.handle(Arrived(0, 0, 2.5)) == [Drop(0, 0, DropReason.EARLY)]
    assert sync.handle(Joined(2, 3.0)) == [Hold(2)]  # two members: still one short
    assert sync.handle(Joined(3, 4.0)) == [Release((0, 2, 3))]  # 1 left: not released
    assert run_round(sync, [0, 2, 3]) == Apply(0, (0, 2, 3))


def test_after_the_gate_opens_a_leave_lets_the_rest_go_on():
    sync = started(2)
    assert sync.handle(Arrived(0, 0, 1.0)) == [Keep(0, 0)]
    assert sync.handle(Left(1, 2.0)) == [Apply(0, (0,))]
    assert sync.version == 1
    assert sync.handle(Joined(2, 3.0)) == []  # a later joiner is not held
    assert run_round(sync, [2, 0]) == Apply(1, (0, 2))


def test_after_the_first_step_fewer_workers_go_on():
    sync = started(3)
    assert run_round(sync, [0, 1, 2]) == Apply(0, (0, 1, 2))
    assert sync.handle(Left(2, 2.0)) == []
    assert run_round(sync, [0, 1]) == Apply(1, (0, 1))


@pytest.mark.parametrize("order", list(itertools.permutations([4, 0, 9])), ids=str)
def test_arrival_order_does_not_matter(order):
    sync = started(3, [0, 4, 9])
    assert run_round(sync, order) == Apply(0, (0, 4, 9))


# Drops --------------------------------------------------------------------------------


def test_update_for_the_previous_version_is_dropped_as_late():
    sync = started(2)
    run_round(sync, [0, 1])
    assert sync.handle(Arrived(1, 0, 5.0)) == [Drop(1, 0, DropReason.LATE)]
    assert sync.version == 1
    # The late update does not count for version 1: 1 must still push.
    assert sync.handle(Arrived(0, 1, 6.0)) == [Keep(0, 1)]
    assert sync.handle(Arrived(1, 1, 7.0)) == [Keep(1, 1), Apply(1, (0, 1))]


def test_update_for_an_older_version_is_dropped_as_stale():
    sync = started(2)
    run_round(sync, [0, 1])
    run_round(sync, [1, 0])
    assert sync.handle(Arrived(1, 0, 5.0)) == [Drop(1, 0, DropReason.STALE)]
    assert sync.handle(Arrived(0, 1, 5.0)) == [Drop(0, 1, DropReason.LATE)]
    assert sync.version == 2
    assert run_round(sync, [0, 1]) == Apply(2, (0, 1))


@pytest.mark.parametrize("version", [1, 2, 10**6])
def test_future_update_is_dropped(version):
    sync = started(2)
    assert sync.handle(Arrived(0, version, 1.0)) == [Drop(0, version, DropReason.AHEAD)]
    assert sync.handle(Arrived(1, 0, 2.0)) == [Keep(1, 0)]  # 0 still missing
    assert sync.handle(Arrived(0, 0, 3.0)) == [Keep(0, 0), Apply(0, (0, 1))]


def test_duplicate_in_the_same_version_is_dropped():
    sync = started(2)
    assert sync.handle(Arrived(0, 0, 1.0)) == [Keep(0, 0)]
    assert sync.handle(Arrived(0, 0, 2.0)) == [Drop(0, 0, DropReason.DUPLICATE)]
    assert sync.version == 0
    assert sync.handle(Arrived(1, 0, 3.0)) == [Keep(1, 0), Apply(0, (0, 1))]


@pytest.mark.parametrize("version", [0, 1])
def test_update_from_a_worker_that_never_joined_is_dropped(version):
    sync = started(2)
    assert sync.handle(Arrived(5, version, 1.0)) == [Drop(5, version, DropReason.NOT_MEMBER)]
    run_round(sync, [0, 1])


def test_update_from_a_worker_that_left_is_dropped():
    sync = started(3)
    run_round(sync, [0, 1, 2])
    assert sync.handle(Left(2, 2.0)) == []
    assert sync.handle(Arrived(2, 1, 3.0)) == [Drop(2, 1, DropReason.NOT_MEMBER)]
    assert run_round(sync, [0, 1]) == Apply(1, (0, 1))


# Membership ---------------------------------------------------------------------------


def test_leaving_before_pushing_releases_the_barrier():
    sync = started(3)
    run_round(sync, [0, 1, 2])
    assert sync.handle(Arrived(0, 1, 2.0)) == [Keep(0, 1)]
    assert sync.handle(Arrived(2, 1, 3.0)) == [Keep(2, 1)]
    assert sync.handle(Left(1, 4.0)) == [Apply(1, (0, 2))]
    assert sync.version == 2
    assert run_round(sync, [0, 2]) == Apply(2, (0, 2))


def test_leaving_while_others_are_missing_applies_nothing():
    sync = started(3)
    run_round(sync, [0, 1, 2])
    assert sync.handle(Arrived(0, 1, 2.0)) == [Keep(0, 1)]
    assert sync.handle(Left(1, 3.0)) == []
    assert sync.version == 1
    assert sync.handle(Arrived(2, 1, 4.0)) == [Keep(2, 1), Apply(1, (0, 2))]


def test_leaving_when_nothing_is_held_applies_nothing():
    sync = started(2)
    run_round(sync, [0, 1])
    assert sync.handle(Left(0, 2.0)) == []
    assert sync.handle(Left(1, 3.0)) == []
    assert sync.version == 1


def test_leave_of_an_unknown_worker_changes_nothing():
    sync = started(2)
    assert sync.handle(Arrived(0, 0, 1.0)) == [Keep(0, 0)]
    assert sync.handle(Left(8, 2.0)) == []
    assert sync.handle(Arrived(1, 0, 3.0)) == [Keep(1, 0), Apply(0, (0, 1))]


def test_leaving_after_pushing_still_counts():
    sync = started(3)
    run_round(sync, [0, 1, 2])
    assert sync.handle(Arrived(1, 1, 2.0)) == [Keep(1, 1)]
    assert sync.handle(Left(1, 3.0)) == []
    assert sync.handle(Arrived(0, 1, 4.0)) == [Keep(0, 1)]
    assert sync.handle(Arrived(2, 1, 5.0)) == [Keep(2, 1), Apply(1, (0, 1, 2))]
    assert run_round(sync, [0, 2]) == Apply(2, (0, 2))


def test_last_member_leaving_after_others_pushed_and_left():
    sync = started(2)
    run_round(sync, [0, 1])
    assert sync.handle(Arrived(0, 1, 2.0)) == [Keep(0, 1)]
    assert sync.handle(Left(0, 3.0)) == []
    assert sync.handle(Left(1, 4.0)) == [Apply(1, (0,))]


def test_joining_mid_version_must_push_before_it_completes():
    sync = started(2)
    run_round(sync, [0, 1])
    assert sync.handle(Arrived(0, 1, 2.0)) == [Keep(0, 1)]
    assert sync.handle(Joined(2, 3.0)) == []
    assert sync.handle(Arrived(1, 1, 4.0)) == [Keep(1, 1)]
    assert sync.version == 1
    assert sync.handle(Arrived(2, 1, 5.0)) == [Keep(2, 1), Apply(1, (0, 1, 2))]
    assert run_round(sync, [2, 1, 0]) == Apply(2, (0, 1, 2))


def test_joining_twice_is_one_member():
    sync = started(2)
    assert sync.handle(Joined(1, 1.0)) == []
    assert run_round(sync, [0, 1]) == Apply(0, (0, 1))


# Stall --------------------------------------------------------------------------------


def test_stall_is_reported_once_a_period():
    sync = started(3, stall_after_s=10.0)
    assert sync.handle(Arrived(0, 0, 100.0)) == [Keep(0, 0)]
    assert sync.handle(Arrived(2, 0, 104.0)) == [Keep(2, 0)]
    assert sync.handle(Tick(100.0)) == []
    assert sync.handle(Tick(109.5)) == []
    assert sync.handle(Tick(110.0)) == [Stall(0, (1,), 10.0)]  # from the first arrival
    assert sync.handle(Tick(110.0)) == []
    assert sync.handle(Tick(115.0)) == []
    assert sync.handle(Tick(119.5)) == []
    assert sync.handle(Tick(120.0)) == [Stall(0, (1,), 20.0)]
    assert sync.handle(Tick(125.0)) == []
    assert sync.handle(Tick(136.0)) == [Stall(0, (1,), 36.0)]
    assert sync.handle(Tick(145.0)) == []
    assert sync.handle(Tick(146.0)) == [Stall(0, (1,), 46.0)]
    assert sync.version == 0


def test_stall_names_the_missing_workers_sorted():
    sync = started(4, [9, 4, 7, 1], stall_after_s=5.0)
    assert sync.handle(Arrived(7, 0, 0.0)) == [Keep(7, 0)]
    assert sync.handle(Tick(5.0)) == [Stall(0, (1, 4, 9), 5.0)]
    assert sync.handle(Arrived(4, 0, 6.0)) == [Keep(4, 0)]
    assert sync.handle(Tick(10.0)) == [Stall(0, (1, 9), 10.0)]


def test_stall_period_restarts_with_each_version():
    sync = started(2, stall_after_s=10.0)
    assert sync.handle(Arrived(0, 0, 0.0)) == [Keep(0, 0)]
    assert sync.handle(Tick(25.0)) == [Stall(0, (1,), 25.0)]
    assert sync.handle(Arrived(1, 0, 26.0)) == [Keep(1, 0), Apply(0, (0, 1))]
    assert sync.handle(Tick(100.0)) == []  # nothing held for version 1
    assert sync.handle(Arrived(1, 1, 200.0)) == [Keep(1, 1)]
    assert sync.handle(Tick(209.0)) == []
    assert sync.handle(Tick(210.0)) == [Stall(1, (0,), 10.0)]


@pytest.mark.parametrize("now", [0.0, 31.0, 1e9])
def test_no_stall_when_nothing_is_held(now):
    sync = Sync(workers=2)
    assert sync.handle(Tick(now)) == []
    sync = started(2)
    assert sync.handle(Tick(now)) == []
    run_round(sync, [0, 1])
    assert sync.handle(Tick(now + 100.0)) == []


def test_tick_changes_nothing():
    sync = started(2, stall_after_s=1.0)
    assert sync.handle(Arrived(0, 0, 0.0)) == [Keep(0, 0)]
    assert sync.handle(Tick(50.0)) == [Stall(0, (1,), 50.0)]
    assert sync.version == 0
    assert sync.handle(Arrived(1, 0, 51.0)) == [Keep(1, 0), Apply(0, (0, 1))]


# Arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, -1])
def test_invalid_workers(workers):
    with pytest.raises(ValueError, match=r"^workers must be at least 1, got -?\d+$"):
        Sync(workers=workers)


@pytest.mark.parametrize("seconds", [0, 0.0, -1.0, -math.inf])
def test_invalid_stall_after(seconds):
    with pytest.raises(ValueError, match="stall_after_s"):
        Sync(workers=1, stall_after_s=seconds)


def test_nan_stall_after_is_refused():
    with pytest.raises(ValueError, match="stall_after_s"):
        Sync(workers=1, stall_after_s=math.nan)


@pytest.mark.parametrize(
    "event", [None, "tick", 1.0, (0, 0, 0.0), Keep(0, 0), Apply(0, (0,)), Tick],
    ids=["none", "str", "float", "tuple", "keep", "apply", "class"],
)
def test_not_an_event(event):
    sync = started(1)
    with pytest.raises(TypeError, match="not a strategy event"):
        sync.handle(event)
    assert sync.version == 0
