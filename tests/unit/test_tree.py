"""Unit: a coordinator's state as JSON and tensors, and back (bus.tree), with no pickle:
what a standby's replica carries."""

from __future__ import annotations

import math

import pytest
import torch

from tensorbus.bus.tree import MAX_JSON_BYTES, PACK_BYTES, TreeError, flatten, unflatten

pytestmark = pytest.mark.timeout(30)


def test_a_checkpoint_like_state_comes_back_with_its_types_and_its_tensors_uncopied() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    weights = [torch.arange(20_000.0)]  # (over PACK_BYTES: sent as it lies)
    state = {"version": 7, "optimizer": optimizer.state_dict(), "weights": weights,
             "positions": {0: 12, 3: 4}, "scheduler": ({"last_epoch": 2}, 1), "lr": math.inf,
             "names": None, "flag": True, "strategy": "sync"}
    skeleton, tensors = flatten(state)
    assert isinstance(skeleton, bytes) and b"pickle" not in skeleton
    assert any(t.data_ptr() == weights[0].data_ptr() for t in tensors)  # not copied
    back = unflatten(skeleton, tensors)
    assert back["positions"] == {0: 12, 3: 4}  # integer keys stay integers
    assert back["scheduler"] == [{"last_epoch": 2}, 1]  # tuples come back as lists
    assert back["lr"] == math.inf and back["names"] is None and back["flag"] is True
    assert any(back["weights"][0] is t for t in tensors)
    restored = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    restored.load_state_dict(back["optimizer"])
    for a, b in zip(restored.state_dict()["state"].values(),
                    optimizer.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert restored.param_groups[0]["lr"] == 0.01


def test_small_tensors_go_packed_one_buffer_a_dtype_and_come_back_as_they_were() -> None:
    """An optimizer's state holds a tensor or more a parameter: many small ones travel as
    one buffer per dtype, so that a model of many parameters fits in one message."""
    state = {"steps": [torch.tensor(float(i)) for i in range(500)],
             "masks": [torch.tensor([i, i + 1]) for i in range(300)],
             "big": torch.zeros(PACK_BYTES // 4)}
    skeleton, tensors = flatten(state, most=3)
    assert len(tensors) == 3  # the big one, then a float32 and an int64 buffer
    back = unflatten(skeleton, tensors)
    assert [float(t) for t in back["steps"]] == list(range(500))
    assert [t.tolist() for t in back["masks"]] == [[i, i + 1] for i in range(300)]
    assert back["steps"][7].shape == () and back["masks"][0].dtype == torch.int64
    with pytest.raises(TreeError, match="the state needs 3 tensors, and a message carries at most 2"):
        flatten(state, most=2)


def test_a_dict_shaped_like_a_marker_is_not_taken_for_one() -> None:
    skeleton, tensors = flatten({"t": 0, "d": [1]})
    assert unflatten(skeleton, tensors) == {"t": 0, "d": [1]}


@pytest.mark.parametrize("tree, error", [
    ({"x": object()}, "state['x']: a object: not a value that is sent"),
    ({1.5: 2}, "state: a key of type float"),
    ({"gpu": torch.empty(0, device="meta")}, "state['gpu']: a tensor on meta"),
])
def test_what_cannot_be_sent_is_named_where_it_lies(tree: object, error: str) -> None:
    with pytest.raises(TreeError, match=error.replace("[", r"\[").replace("]", r"\]")):
        flatten(tree)


@pytest.mark.parametrize("skeleton, count, error", [
    (b"not json", 0, "not a tree's JSON"),
    (b'{"t": 1}', 1, r"state: tensor 1 of 1"),
    (b'{"t": 0, "x": 1}', 1, "is not part of a tree"),
    (b'{"d": [[1.5, 2]]}', 0, "a dict entry that is not"),
    (b'{"x": 1}', 0, "is not part of a tree"),
    (b"[1, 2]", 1, "1 tensors sent, 0 of them in the tree"),
    (b'{"p": [0, 1, [2]]}', 1, "2 elements at 1 of a buffer of 1"),
    (b'{"p": [0, 0, [-1]]}', 1, "a packed tensor's shape"),
])
def test_json_that_is_not_a_tree_is_refused(skeleton: bytes, count: int, error: str) -> None:
    with pytest.raises(TreeError, match=error):
        unflatten(skeleton, [torch.zeros(1)] * count)


def test_a_tree_over_the_limit_is_refused_both_ways() -> None:
    with pytest.raises(TreeError, match="over"):
        flatten({"names": "x" * (MAX_JSON_BYTES + 1)})
    with pytest.raises(TreeError, match="over"):
        unflatten(b" " * (MAX_JSON_BYTES + 1), [])
