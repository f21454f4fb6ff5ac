"""A tree of plain values and tensors as JSON and a list of tensors, and back, with no pickle.

What a Replica carries (nodes.replication): a coordinator's state, as a checkpoint holds it
(nodes.run_checkpoints): weights, an optimizer's and a scheduler's state dicts, positions,
counts. The tree may hold dicts (str or int keys), lists and tuples (both come back as
lists), str, int, float (NaN and infinities included), bool, None, and CPU tensors.

- A tensor becomes {"t": i}: the index of its entry in the list. It is sent as it lies in
  memory where it is contiguous (no copy: the codec sends its bytes as frames).
- A small tensor (under PACK_BYTES: an optimizer's step counts, a bias's momentum) is copied
  into one buffer with the others of its dtype, and becomes {"p": [i, offset, shape]}: a
  model of many parameters would otherwise need more tensors than a message may carry.
- A dict becomes {"d": [[key, value], ...]}, so that integer keys (an optimizer's per
  parameter state) come back as integers and no key can pass for a tensor's marker.

`unflatten` checks what it reads: a JSON value of another shape, a key of another type or
a tensor index out of range raises TreeError, naming where in the tree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

MAX_JSON_BYTES: Final = 1 << 24  # a state's tree, tensors aside: counts and hyperparameters
PACK_BYTES: Final = 1 << 16  # tensors smaller than this go packed, one buffer a dtype


class TreeError(ValueError):
    """A tree that cannot be sent, or JSON that is not one this module made."""


def flatten(tree: Any, *, most: int | None = None,
            keep: Callable[[torch.Tensor], bool] | None = None) -> tuple[bytes, list[torch.Tensor]]:
    """The tree as JSON bytes, and its tensors in the order their markers name them: at
    most `most` of them (TreeError if more are needed). `keep`: tensors never packed,
    however small (what goes by reference: nodes.replication)."""
    tensors: list[torch.Tensor] = []
    small: dict[torch.dtype, list[torch.Tensor]] = {}  # packed after the walk
    packs: dict[torch.dtype, list[dict[str, Any]]] = {}  # their markers, to be numbered

    def walk(node: Any, where: str) -> Any:
        match node:
            case torch.Tensor():
                if node.device.type != "cpu":
                    raise TreeError(f"{where}: a tensor on {node.device}: only CPU tensors are sent")
                if node.numel() * node.element_size() < PACK_BYTES and not (keep and keep(node)):
                    marker: dict[str, Any] = {"p": [-1, sum(t.numel() for t in small.get(node.dtype, ())),
                                                    list(node.shape)]}
                    small.setdefault(node.dtype, []).append(node.detach().reshape(-1))
                    packs.setdefault(node.dtype, []).append(marker)
                    return marker
                tensors.append(node.detach() if node.is_contiguous() else node.detach().contiguous())
                return {"t": len(tensors) - 1}
            case dict():
                pairs = []
                for key, value in node.items():
                    if type(key) not in (str, int):
                        raise TreeError(f"{where}: a key of type {type(key).__name__}: only str "
                                        "and int keys are sent")
                    pairs.append([key, walk(value, f"{where}[{key!r}]")])
                return {"d": pairs}
            case list() | tuple():
                return [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]
            case None | bool() | int() | float() | str():
                return node
        raise TreeError(f"{where}: a {type(node).__name__}: not a value that is sent")

    walked = walk(tree, "state")
    for dtype, parts in small.items():
        tensors.append(torch.cat(parts))
        for marker in packs[dtype]:
            marker["p"][0] = len(tensors) - 1
    if most is not None and len(tensors) > most:
        raise TreeError(f"the state needs {len(tensors)} tensors, and a message carries at most "
                        f"{most}: a model of fewer parameter tensors can have a standby")
    skeleton = json.dumps(walked, separators=(",", ":")).encode()
    if len(skeleton) > MAX_JSON_BYTES:
        raise TreeError(f"the state's tree is {len(skeleton)} bytes of JSON, over {MAX_JSON_BYTES}")
    return skeleton, tensors


def unflatten(skeleton: bytes | bytearray | memoryview, tensors: Sequence[torch.Tensor]) -> Any:
    """The tree `flatten` made, its tensors those given (in the same order)."""
    if memoryview(skeleton).nbytes > MAX_JSON_BYTES:
        raise TreeError(f"a tree of {memoryview(skeleton).nbytes} bytes, over {MAX_JSON_BYTES}")
    try:
        parsed = json.loads(bytes(skeleton))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TreeError(f"not a tree's JSON: {e}") from None
    used: set[int] = set()

    def walk(node: Any, where: str) -> Any:
        match node:
            case {"t": int() as index} if len(node) == 1:
                if not 0 <= index < len(tensors):
                    raise TreeError(f"{where}: tensor {index} of {len(tensors)}")
                used.add(index)
                return tensors[index]
            case {"p": [int() as index, int() as offset, list() as shape]} if len(node) == 1:
                if not 0 <= index < len(tensors) or tensors[index].dim() != 1:
                    raise TreeError(f"{where}: packed in tensor {index} of {len(tensors)}, not a buffer")
                if not all(type(d) is int and d >= 0 for d in shape):
                    raise TreeError(f"{where}: a packed tensor's shape {shape!r:.60}")
                numel = math.prod(shape)
                if not 0 <= offset <= offset + numel <= tensors[index].numel():
                    raise TreeError(f"{where}: {numel} elements at {offset} of a buffer of "
                                    f"{tensors[index].numel()}")
                used.add(index)
                return tensors[index][offset:offset + numel].view(shape)
            case {"d": list() as pairs} if len(node) == 1:
                out: dict[Any, Any] = {}
                for pair in pairs:
                    if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int)):
                        raise TreeError(f"{where}: a dict entry that is not [str or int key, value]")
                    out[pair[0]] = walk(pair[1], f"{where}[{pair[0]!r}]")
                return out
            case list():
                return [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]
            case None | bool() | int() | float() | str():
                return node
        raise TreeError(f"{where}: {type(node).__name__} {str(node)[:60]!r} is not part of a tree")

    tree = walk(parsed, "state")
    if len(used) != len(tensors):
        raise TreeError(f"{len(tensors)} tensors sent, {len(used)} of them in the tree")
    return tree
