"""The benchmark's report: ratios are taken within a round, against the best baseline.
And benchmarks/timeline.py reads a version's parts off a trace as it should, and
benchmarks/cpu_profile.py names torch's kernels and tabulates medians as it should.

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
from benchmarks import bench, cpu_profile, timeline

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


def _span(track: int, name: str, ts: float, dur: float, version: int) -> dict[str, object]:
    return {"ph": "X", "pid": track, "name": name, "ts": ts, "dur": dur,
            "args": {"version": version}}


def test_the_timeline_takes_each_part_of_a_version_from_the_trace() -> None:
    events: list[dict[str, object]] = []
    for v in range(1, 5):  # a version every 10 ms (in microseconds, as traces are)
        t = 10_000.0 * v
        events += [_span(0, "apply", t, 600, v), _span(0, "broadcast", t + 600, 400, v),
                   _span(1, "compute", t + 2000, 4000, v), _span(1, "push", t + 6000, 500, v),
                   _span(2, "compute", t + 3000, 4000, v), _span(2, "push", t + 7000, 2000, v)]
    events.append({"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "x"}})
    figures = timeline.timeline(events, first=1)  # versions 2 to 4
    assert figures["shard 0: apply (the step)"] == 0.6
    assert figures["shard 0: broadcast (snapshot and send)"] == 0.4
    assert figures["version to version (apply to next apply)"] == 10.0
    assert figures["worker 1: push to shard 0 (over TCP)"] == 2.0
    assert figures["worker 0: shard 0's broadcast to its next compute"] == 1.0
    assert figures["worker 1: shard 0's broadcast to its next compute"] == 2.0


def test_cpu_profile_names_torch_kernels_and_tabulates_medians_by_contender() -> None:
    copy = ("[.] c10::function_ref<void (char**, long const*, long, long)>::callback_fn<at::"
            "native::AVX2::VectorizedLoop2d<at::native::AVX2::direct_copy_kernel(at::"
            "TensorIteratorBase&)::{lambda()#3}>")
    add = ("[.] c10::function_ref<void (char**, long const*, long, long)>::callback_fn<at::native"
           "::(anonymous namespace)::add_kernel(at::TensorIteratorBase&, c10::Scalar const&)>")
    assert cpu_profile._short(copy) == "torch direct_copy_kernel"
    assert cpu_profile._short(add) == "torch add_kernel"
    assert cpu_profile._short("[k] _copy_to_iter") == "_copy_to_iter"
    assert len(cpu_profile._short("[.] " + "x" * 100)) == 60
    rounds = {"A": [{"dso": {"libpython": 1.0, "libtorch": 5.0}},
                    {"dso": {"libpython": 3.0, "libtorch": 7.0}}],
              "B": [{"dso": {"libtorch": 2.0}}, {"dso": {"libtorch": 4.0, "kernel": 9.0}}]}
    lines = cpu_profile._table(rounds, "dso", 2)
    # The rows with the largest median first, at most 2; a label a round lacks counts 0.
    assert lines == ["| dso | A | B |", "|---|---:|---:|", "| libtorch | 6.00 | 3.00 |",
                     "| kernel | 0.00 | 4.50 |"]
