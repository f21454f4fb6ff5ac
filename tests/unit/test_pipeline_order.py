"""Unit: the order of a pipeline stage's micro-batches (nodes.pipeline_order), checked by
running every stage of a pipeline at once in a simulation: what each stage sends goes to
its neighbour's queue, a stage waits only where what it needs has not come, and the step
must end with every micro-batch forward and backward on every stage, in unit-time slots
that give the bubble (P - 1) / (M + P - 1)."""

from __future__ import annotations

import pytest

from tensorbus.nodes.pipeline_order import (
    Action,
    Op,
    Schedule,
    bubble,
    held_at_most,
    order,
)

pytestmark = pytest.mark.timeout(10)

F, B = Op.FORWARD, Op.BACKWARD


def simulate(schedule: Schedule, stages: int, micro: int) -> int:
    """Run every stage's order in unit-time slots (one action a slot where its input has
    come); the slots the step takes. Fails on a deadlock."""
    orders = [order(schedule, s, stages, micro) for s in range(stages)]
    done: set[tuple[int, Op, int]] = set()
    position = [0] * stages
    slot = 0
    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        ready = []
        for s, o in enumerate(orders):
            if position[s] == len(o):
                continue
            op, m = o[position[s]]
            if op is F:
                needs = s == 0 or (s - 1, F, m) in done
            else:
                needs = (s, F, m) in done and (s == stages - 1 or (s + 1, B, m) in done)
            if needs:
                ready.append((s, op, m))
        assert ready, f"deadlock at slot {slot}: {position}"
        for s, op, m in ready:  # (what a slot computes is seen in the next)
            done.add((s, op, m))
            position[s] += 1
        slot += 1
    return slot


def test_one_f_one_b_on_four_stages_by_hand() -> None:
    assert order(Schedule.ONE_F_ONE_B, 0, 4, 4) == [
        Action(F, 0), Action(F, 1), Action(F, 2), Action(F, 3),
        Action(B, 0), Action(B, 1), Action(B, 2), Action(B, 3)]
    assert order(Schedule.ONE_F_ONE_B, 2, 4, 4) == [
        Action(F, 0), Action(F, 1), Action(B, 0), Action(F, 2), Action(B, 1), Action(F, 3),
        Action(B, 2), Action(B, 3)]
    assert order(Schedule.ONE_F_ONE_B, 3, 4, 2) == [
        Action(F, 0), Action(B, 0), Action(F, 1), Action(B, 1)]


def test_gpipe_is_every_forward_then_every_backward() -> None:
    assert order(Schedule.GPIPE, 1, 2, 3) == [
        Action(F, 0), Action(F, 1), Action(F, 2), Action(B, 0), Action(B, 1), Action(B, 2)]


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (1, 4), (2, 1), (2, 8), (4, 2), (4, 4),
                                               (4, 16), (5, 3)])
def test_every_stage_runs_each_micro_batch_once_each_way(schedule: Schedule, stages: int,
                                                         micro: int) -> None:
    for s in range(stages):
        actions = order(schedule, s, stages, micro)
        assert sorted(actions) == sorted([Action(F, m) for m in range(micro)]
                                         + [Action(B, m) for m in range(micro)])
        assert [a.micro for a in actions if a.op is B] == list(range(micro))  # as accumulated
        assert all(actions.index(Action(F, m)) < actions.index(Action(B, m)) for m in range(micro))


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize(("stages", "micro"), [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_the_stages_together_never_deadlock_and_take_m_plus_p_minus_1_rounds(
        schedule: Schedule, stages: int, micro: int) -> None:
    # A forward and a backward take a slot each: 2(M + P - 1) slots, of which each stage
    # computes 2M; the rest is the bubble.
    slots = simulate(schedule, stages, micro)
    assert slots == 2 * (micro + stages - 1)
    assert 1 - 2 * micro / slots == pytest.approx(bubble(stages, micro))


@pytest.mark.parametrize(("stages", "micro"), [(4, 8), (4, 2), (2, 16)])
def test_one_f_one_b_holds_at_most_the_depth_left_and_gpipe_every_micro_batch(
        stages: int, micro: int) -> None:
    for s in range(stages):
        assert held_at_most(order(Schedule.ONE_F_ONE_B, s, stages, micro)) == min(stages - s, micro)
        assert held_at_most(order(Schedule.GPIPE, s, stages, micro)) == micro


def test_the_bubble_formula() -> None:
    assert bubble(1, 8) == 0.0
    assert bubble(4, 4) == pytest.approx(3 / 7)
    assert bubble(2, 1) == pytest.approx(0.5)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="stage 4 of 4"):
        order(Schedule.GPIPE, 4, 4, 2)
    with pytest.raises(ValueError, match="micro_batches must be at least 1"):
        order(Schedule.GPIPE, 0, 4, 0)
    with pytest.raises(ValueError, match="choose from 1f1b, gpipe"):
        Schedule.parse("zb")
