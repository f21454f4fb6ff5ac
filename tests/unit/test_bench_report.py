"""The benchmarks' reports, without running a benchmark: ratios are taken within a round,
against the best baseline; every result file records its run's metadata; a checkout's
tensorbus is started the way its layout needs; the entry point knows every benchmark.

`benchmarks/bench.py` turns rounds of figures into docs/performance.md's tables; a ratio with
several denominators (raw pyzmq at two frame sizes) is taken against the fastest of them
in the same round, so that the bus is held to raw pyzmq's best, not to its 1 MiB frames.
benchmarks/timeline.py reads a version's parts off a trace, and benchmarks/cpu_profile.py
names torch's kernels and tabulates medians.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import struct
import sys
import zlib
from pathlib import Path

import pytest

# benchmarks/ is not installed: import it from this checkout however pytest was started.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import bench, checkout, cpu_profile, report, timeline
from benchmarks.__main__ import BENCHMARKS, unstamped

pytestmark = pytest.mark.timeout(30)

META = report.Meta(command="python -m benchmarks bench --rounds 1", commit="0" * 40 + "+dirty",
                   date="2026-01-02 03:04 UTC", torch="2.1.0+cpu", python="3.11.7",
                   cpu="Some CPU @ 2.80GHz", cores="2 logical cores, 2 usable by this run")


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
    ratios = bench.summarize(rounds, 1.0)["ratios"]
    best = ratios["a/128MB: tensorbus / zmq best chunked"]
    # 512 KiB won the first round, 1 MiB the second, a kept case the third.
    assert (best["max"], best["median"], best["min"]) == (3.6 / 4.5, 3.0 / 4.0, 3.0 / 5.0)
    assert ratios["a/128MB: tensorbus / zmq 1 MiB frames"]["max"] == 3.0 / 3.0
    one_frame = ratios["a/128MB: tensorbus / zmq one frame"]
    assert (one_frame["max"], one_frame["median"], one_frame["min"]) == (3.6 / 1.2, 3.0 / 1.5, 3.0 / 5.0)


def test_a_ratio_is_left_out_of_rounds_that_lack_a_baseline() -> None:
    partial = {k: v for k, v in _round(3.0, 1.5, 3.5, 4.0).items() if k != "a/128MB/zmq-512K"}
    ratios = bench.summarize([partial], 1.0)["ratios"]
    assert "a/128MB: tensorbus / zmq best chunked" not in ratios
    assert ratios["a/128MB: tensorbus / zmq 1 MiB frames"]["median"] == 3.0 / 3.5


def test_markdown_lists_every_case_and_ratio() -> None:
    summary = bench.summarize([_round(3.0, 1.5, 3.5, 4.0)], 1.0)
    text = bench.markdown(summary)
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


def test_markdown_and_json_results_open_with_the_runs_metadata(tmp_path: Path) -> None:
    md = report.write_markdown(tmp_path / "deep" / "x.md", "| a | b |\n|---|---|\n", META)
    text = md.read_text()
    assert report.read_markdown_meta(text) == {
        "command": META.command, "commit": META.commit, "date": META.date, "torch": META.torch,
        "python": META.python, "cpu": META.cpu, "cores": META.cores}
    assert text.endswith("\n\n| a | b |\n|---|---|\n")  # a blank line ends the metadata
    stored = json.loads(report.write_json(tmp_path / "x.json", {"k": [1.5]}, META).read_text())
    assert stored == {"meta": report.read_markdown_meta(text), "result": {"k": [1.5]}}
    assert unstamped(tmp_path) == []
    (tmp_path / "bare.md").write_text("| a | b |\n")
    assert unstamped(tmp_path) == [str(tmp_path / "bare.md")]
    assert unstamped(tmp_path / "nothing") == ["(none)"]


def _png() -> bytes:
    """A 1x1 grey PNG."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0\x80"))
            + chunk(b"IEND", b""))


def test_a_png_is_stamped_once_and_keeps_its_image(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(_png())
    assert report.read_png_meta(path) == {}
    report.stamp_png(path, META)
    again = dataclasses.replace(META, date="2026-02-03 04:05 UTC")
    report.stamp_png(path, again)  # stamped anew: the first stamp replaced, not kept beside
    assert report.read_png_meta(path)["date"] == "2026-02-03 04:05 UTC"
    data = path.read_bytes()
    assert data.count(b"tEXt") == 1 and b"IDAT" in data and data.endswith(b"IEND\xaeB`\x82")
    (tmp_path / "not.png").write_bytes(b"GIF89a")
    with pytest.raises(ValueError, match="not a PNG"):
        report.stamp_png(tmp_path / "not.png", META)


def test_the_cpu_model_comes_from_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) @ 2.80GHz\n")
    assert report.cpu_model(x86) == "Intel(R) Xeon(R) @ 2.80GHz"
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nCPU part\t: 0xd0c\n\nModel\t\t: Raspberry Pi 4 Model B\n")
    assert report.cpu_model(arm) == "Raspberry Pi 4 Model B"
    assert report.cpu_model(tmp_path / "absent")  # the platform module's answer, not nothing


def test_the_commit_is_heads_and_says_dirty(tmp_path: Path) -> None:
    found = report.commit()
    if found.startswith("unknown"):
        pytest.skip("not a git checkout")
    head, _, dirty = found.partition("+")
    assert len(head) == 40 and set(head) <= set("0123456789abcdef") and dirty in ("", "dirty")
    assert report.commit(tmp_path).startswith("unknown")


def test_a_checkout_of_one_package_runs_as_tensorbus_through_a_link(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("")
    with checkout.cli(tmp_path) as (argv, env):
        assert argv == [sys.executable, "-m", "tensorbus"]
        links, tree = env["PYTHONPATH"].split(os.pathsep)
        assert Path(links, "tensorbus").resolve() == tmp_path.resolve() and tree == str(tmp_path)
    assert not Path(links).exists()  # the link goes with the block


def test_an_older_checkout_runs_as_run_by_bare_names(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with checkout.cli(tmp_path) as (argv, env):
        assert argv == [sys.executable, "-m", "run"]  # an old layout's: bare names allowed
        assert env["PYTHONPATH"] == str(tmp_path)


def test_the_entry_point_knows_every_benchmark_and_each_that_writes_takes_out(
        capsys: pytest.CaptureFixture[str]) -> None:
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    helpers = {"__init__", "__main__", "report", "checkout", "steps", "mlp", "pipeline_mlp"}
    assert {p.stem for p in here.glob("*.py")} - helpers == set(BENCHMARKS)
    for name, b in BENCHMARKS.items():
        module = importlib.import_module(f"benchmarks.{name}")
        with pytest.raises(SystemExit) as help_:
            module.main(["--help"], META)
        assert help_.value.code == 0
        usage = capsys.readouterr().out
        assert usage.startswith(f"usage: python -m benchmarks {name}"), name
        assert ("--out" in usage) == b.writes, name
