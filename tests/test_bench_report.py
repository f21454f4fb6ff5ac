"""The benchmark's report: ratios are taken within a round, against the best baseline.

`benchmarks/bench.py` turns rounds of figures into the README's tables; a ratio with
several denominators (raw pyzmq at two frame sizes) is taken against the fastest of them
in the same round, so that the bus is held to raw pyzmq's best, not to its 1 MiB frames.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench

pytestmark = pytest.mark.timeout(30)

ARGS = argparse.Namespace(rounds=2, quick=False, only="a")


def _round(bus: float, one_frame: float, mib: float, half_mib: float, *,
           kept: float = 0.0) -> dict[str, float]:
    """A round of part (a) at 128 MB; the raw cases with kept memory all at `kept`."""
    return {"a/128MB/tensorbus": bus, "a/128MB/zmq-1frame": one_frame,
            "a/128MB/zmq-chunked": mib, "a/128MB/zmq-512K": half_mib,
            "a/128MB/zmq-1frame-kept": kept, "a/128MB/zmq-chunked-kept": kept,
            "a/128MB/zmq-512K-kept": kept}


def test_a_ratio_with_several_baselines_takes_the_fastest_of_each_round() -> None:
    rounds = [_round(3.0, 1.5, 3.5, 4.0), _round(3.6, 1.2, 4.5, 4.0, kept=1.0),
              _round(3.0, 1.0, 3.0, 3.0, kept=5.0)]
    ratios = bench.summarize(rounds, 1.0, ARGS)["ratios"]
    best = ratios["a/128MB: tensorbus / zmq best chunked"]
    # 512 KiB won the first round, 1 MiB the second, a kept case the third.
    assert (best["max"], best["median"], best["min"]) == (3.6 / 4.5, 3.0 / 4.0, 3.0 / 5.0)
    assert ratios["a/128MB: tensorbus / zmq 1 MiB frames"]["max"] == 3.0 / 3.0
    one_frame = ratios["a/128MB: tensorbus / zmq one frame"]
    assert (one_frame["max"], one_frame["median"], one_frame["min"]) == (3.6 / 1.2, 3.0 / 1.5, 3.0 / 5.0)


def test_a_ratio_is_left_out_of_rounds_that_lack_a_baseline() -> None:
    partial = {k: v for k, v in _round(3.0, 1.5, 3.5, 4.0).items() if k != "a/128MB/zmq-512K"}
    ratios = bench.summarize([partial], 1.0, ARGS)["ratios"]
    assert "a/128MB: tensorbus / zmq best chunked" not in ratios
    assert ratios["a/128MB: tensorbus / zmq 1 MiB frames"]["median"] == 3.0 / 3.5


def test_markdown_lists_every_case_and_ratio() -> None:
    report = bench.summarize([_round(3.0, 1.5, 3.5, 4.0)], 1.0, ARGS)
    text = bench.markdown(report)
    assert "| a/128MB/zmq-512K | 4 | 4 | 4 | GB/s |" in text
    assert "| a/128MB: tensorbus / zmq best chunked | 0.75 | 0.75 | 0.75 | >= 0.8 wanted |" in text
