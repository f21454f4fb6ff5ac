"""Unit tests of `nodes.fragments`: what a streaming worker keeps beside its model, and
which fragments a run of versions changed."""

import pytest
import torch

from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.fragments import Fragments, changed_between

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("older", "newer", "fragments", "changed"), [
    (4, 5, 3, [1]),  # version 5 averaged fragment 4 mod 3
    (4, 4, 3, []),
    (0, 2, 3, [0, 1]),
    (5, 7, 2, [0, 1]),
    (3, 1000, 4, [0, 1, 2, 3]),  # a pull after a gap: every fragment, once
])
def test_changed_between_names_each_version_s_fragment(older, newer, fragments, changed):
    assert changed_between(older, newer, fragments) == changed


def _flat() -> FlatModel:
    torch.manual_seed(0)
    return FlatModel(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)))


def test_a_push_copies_the_fragment_s_weights_and_mixing_takes_part_of_the_average():
    flat = _flat()
    fragments = Fragments(flat, flat.layout.fragments(2), bits=None, mix=0.25)
    (span,) = fragments.fragments[1].spans  # all but the first weight: elements 6..10
    assert (span.start, span.stop) == (6, 11)
    fragments.fill(1)
    (part,) = fragments.parts[1]
    assert torch.equal(part, flat.weights[0][6:11])
    assert part.data_ptr() != flat.weights[0].data_ptr()  # a copy: the model computes on
    local = flat.weights[0].clone()
    with torch.no_grad():
        fragments.newest[0].add_(4.0)  # a version came: every element 4 higher
    fragments.mix_in([1])
    torch.testing.assert_close(flat.weights[0][6:11], local[6:11] + 0.75 * 4.0)
    assert torch.equal(flat.weights[0][:6], local[:6])  # the other fragment as it was
    fragments.restart()
    assert torch.equal(flat.weights[0], fragments.newest[0])
