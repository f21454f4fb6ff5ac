"""`run.plot`: metrics files written by hand in the real format, each PlotError, and one plot
of two real (short) runs of the digits example.

The drawing tests need matplotlib (an optional dependency) and skip without it; reading and
the errors raised before drawing do not need it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import zygote

from tensorbus.run.plot import PlotError, _moving_average, _read, plot

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def _run_records(strategy: str = "sync", *, steps: int = 40, workers: int = 2,
                 decay: float = 0.05, evals: bool = True, telemetry: bool = True,
                 summary: bool = True) -> list[dict[str, Any]]:
    """A run as the coordinator writes it: start, steps (with worker records), evals, summary."""
    records: list[dict[str, Any]] = [{"event": "start", "wall_s": 1.0}]
    for version in range(1, steps + 1):
        t = 0.01 * version
        if telemetry:
            for rank in range(workers):
                records.append({"event": "worker", "wall_s": 1.0 + t, "rank": rank,
                                "version": version - 1, "clock": version - 1,
                                "compute_s": 0.004 + 0.002 * rank, "comm_s": 0.002,
                                "wait_s": 0.001 * (workers - rank)})
        records.append({"event": "step", "wall_s": 1.0 + t, "version": version, "train_s": t,
                        "loss": 2.3 / (1 + decay * version) + 0.05 * (version % 3),
                        "samples": 64 * workers, "workers": list(range(workers)),
                        "staleness": 0})
    records.append({"event": "straggler", "wall_s": 1.2, "rank": 1, "slow": True})
    if evals:
        for version in (0, steps // 2, steps):
            records.append({"event": "eval", "wall_s": 2.0, "version": version,
                            "samples": 128 * version, "train_s": 0.01 * version,
                            "accuracy": 0.1 + 0.8 * version / steps, "test_loss": 1.0})
    if summary:
        per_worker = {str(rank): {"joins": 1, "pushes": steps, "applied": steps, "dropped": 0,
                                  "held_s": 0.0}
                      for rank in range(workers)}
        if telemetry:
            for counters in per_worker.values():
                counters.update(compute_s=0.2, comm_s=0.1, wait_s=0.05)
        records.append({"event": "summary", "strategy": strategy, "workers": workers,
                        "steps": steps, "samples": 128 * steps, "wall_s": 2.5,
                        "train_s": 0.01 * steps, "final_loss": 0.5, "dropped": {},
                        "per_worker": per_worker, "accuracy": 0.9, "test_loss": 0.4})
    return records


def _image(path: Path) -> Any:
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == PNG_MAGIC
    return image.imread(path)


# Reading -----------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_reading_a_run_takes_steps_evals_and_the_summary(tmp_path: Path) -> None:
    run = _read(_write(tmp_path / "sync-run.jsonl", _run_records()), None)
    assert run.label == "sync-run (sync, 2 workers)"
    assert [v for v, _, _ in run.steps] == list(range(1, 41))
    assert run.figure == "accuracy"
    assert run.evals == [(0.0, 0.1), (0.2, 0.5), (0.4, pytest.approx(0.9))]
    assert run.final == (0.4, 0.9)
    assert run.split == {0: (0.2, 0.1, 0.05), 1: (0.2, 0.1, 0.05)}  # the summary's, not the sums


@pytest.mark.timeout(10)
def test_a_given_label_is_used_as_is(tmp_path: Path) -> None:
    run = _read(_write(tmp_path / "a.jsonl", _run_records()), "sync")
    assert (run.label, run.name) == ("sync", "sync")


@pytest.mark.timeout(10)
def test_without_telemetry_in_the_summary_the_worker_records_are_summed(tmp_path: Path) -> None:
    records = _run_records(steps=10)
    for counters in records[-1]["per_worker"].values():
        for key in ("compute_s", "comm_s", "wait_s"):
            del counters[key]
    split = _read(_write(tmp_path / "a.jsonl", records), None).split
    assert split[0] == pytest.approx((0.04, 0.02, 0.02))
    assert split[1] == pytest.approx((0.06, 0.02, 0.01))


@pytest.mark.timeout(10)
def test_an_old_run_has_no_split_and_a_killed_one_no_summary(tmp_path: Path) -> None:
    old = _read(_write(tmp_path / "old.jsonl", _run_records(telemetry=False)), None)
    assert old.split == {}
    killed = _read(_write(tmp_path / "killed.jsonl", _run_records(summary=False)), None)
    assert (killed.label, killed.final, killed.split[0]) == ("killed", None,
                                                              pytest.approx((0.16, 0.08, 0.08)))


@pytest.mark.timeout(10)
def test_without_accuracy_the_first_figure_of_the_evals_is_taken(tmp_path: Path) -> None:
    records = _run_records(steps=10)
    for record in records:
        if record["event"] in ("eval", "summary"):
            del record["accuracy"]
    run = _read(_write(tmp_path / "a.jsonl", records), None)
    assert run.figure == "test_loss"
    assert run.final == (0.1, 0.4)


@pytest.mark.timeout(10)
def test_a_run_without_evals_keeps_the_summary_accuracy(tmp_path: Path) -> None:
    run = _read(_write(tmp_path / "a.jsonl", _run_records(steps=10, evals=False)), None)
    assert (run.figure, run.evals, run.final) == ("accuracy", [], (0.1, 0.9))


@pytest.mark.timeout(10)
def test_a_resumed_run_counts_its_time_on(tmp_path: Path) -> None:
    first = [r for r in _run_records(steps=10, evals=False) if r["event"] != "summary"]
    second = [r for r in _run_records(steps=10) if r["event"] != "start"]
    resume = {"event": "resume", "wall_s": 0.5, "version": 10, "samples": 1280,
              "checkpoint": "c/10.pt"}
    run = _read(_write(tmp_path / "a.jsonl", [*first, resume, *second]), None)
    times = [t for _, t, _ in run.steps]
    assert len(times) == 20 and times == sorted(times) and times[-1] == pytest.approx(0.2)
    assert run.final == (pytest.approx(0.2), 0.9)


@pytest.mark.timeout(10)
def test_blank_lines_and_a_torn_last_line_are_skipped(tmp_path: Path) -> None:
    records = _run_records(steps=10, summary=False)
    path = tmp_path / "a.jsonl"
    text = "\n" + "".join(json.dumps(r) + "\n\n" for r in records)
    path.write_text(text + '{"event": "step", "wall_s": 1.3, "vers')
    assert len(_read(path, None).steps) == 10


@pytest.mark.timeout(10)
def test_moving_average_spans_the_window_and_fewer_at_the_start() -> None:
    assert _moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert _moving_average([1.0, 3.0], 1) == [1.0, 3.0]


# Errors ------------------------------------------------------------------------------------


def _expect_error(paths: list[Path], out: Path, match: str, **kwargs: Any) -> None:
    with pytest.raises(PlotError, match=match) as raised:
        plot(paths, out, **kwargs)
    assert "\n" not in str(raised.value)
    assert not out.exists()


@pytest.mark.timeout(10)
def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    _expect_error([tmp_path / "nope.jsonl"], tmp_path / "p.png", r"nope\.jsonl does not exist")


@pytest.mark.timeout(10)
def test_a_file_without_steps_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "trace.jsonl", [{"event": "start", "wall_s": 0.1}])
    _expect_error([path], tmp_path / "p.png",
                  r"trace\.jsonl has no step records: is it a --metrics file of tensorbus "
                  r"local or coordinator\?")


@pytest.mark.timeout(10)
def test_a_line_that_is_not_json_is_an_error_unless_it_is_the_last(tmp_path: Path) -> None:
    records = _run_records(steps=5)
    path = tmp_path / "a.jsonl"
    lines = [json.dumps(r) for r in records]
    lines[3] = lines[3][:20]
    path.write_text("\n".join(lines) + "\n")
    _expect_error([path], tmp_path / "p.png", r"a\.jsonl line 4 is not JSON: ")


@pytest.mark.timeout(10)
def test_a_step_without_a_loss_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl", [{"event": "step", "wall_s": 0.1, "version": 1}])
    _expect_error([path], tmp_path / "p.png", r"a\.jsonl line 1: a step record needs numeric")


@pytest.mark.timeout(10)
def test_labels_must_match_the_files(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl", _run_records(steps=5))
    _expect_error([path, path], tmp_path / "p.png", "1 labels for 2 files", labels=["x"])


@pytest.mark.timeout(10)
def test_the_output_directory_must_exist(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl", _run_records(steps=5))
    _expect_error([path], tmp_path / "no" / "p.png", r"no does not exist: create it")
    _expect_error([path], tmp_path / "p.pdf", r"p\.pdf: the plot is a PNG")


@pytest.mark.timeout(10)
def test_without_matplotlib_the_error_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "a.jsonl", _run_records(steps=5))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    _expect_error([path], tmp_path / "p.png", r"pip install 'tensorbus\[plot\]'")


# Drawing -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_two_runs_make_a_png_with_content(tmp_path: Path) -> None:
    a = _write(tmp_path / "sync-run.jsonl", _run_records("sync"))
    b = _write(tmp_path / "async-run.jsonl", _run_records("async", steps=80, decay=0.2))
    out = tmp_path / "p.png"
    assert plot([a, b], out) == out
    pixels = _image(out)
    assert pixels.shape[:2] == (800, 1200)
    assert pixels[..., :3].std() > 0.05
    assert out.stat().st_size < 200_000


@pytest.mark.timeout(60)
def test_different_runs_give_different_images(tmp_path: Path) -> None:
    slow = _write(tmp_path / "slow.jsonl", _run_records("sync", decay=0.01))
    fast = _write(tmp_path / "fast.jsonl", _run_records("sync", decay=0.5))
    first, second = plot([slow], tmp_path / "1.png"), plot([fast], tmp_path / "2.png")
    difference = abs(_image(first)[..., :3] - _image(second)[..., :3])
    assert difference.mean() > 0.001


@pytest.mark.timeout(60)
def test_runs_without_evals_or_telemetry_still_plot(tmp_path: Path) -> None:
    # The empty panels say why in words; an old run and a killed one draw only their losses.
    records = _run_records(evals=False, telemetry=False)
    del records[-1]["accuracy"], records[-1]["test_loss"]  # as a SPEC without evaluate()
    old = _write(tmp_path / "old.jsonl", records)
    killed = _write(tmp_path / "killed.jsonl",
                    _run_records(evals=False, telemetry=False, summary=False))
    out = plot([old, killed], tmp_path / "p.png", labels=["old", "killed"])
    assert _image(out)[..., :3].std() > 0.05


@pytest.mark.timeout(120)
def test_two_real_runs_of_digits_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = []
    for strategy in ("sync", "async"):
        path = tmp_path / f"{strategy}.jsonl"
        done = zygote.shared().run(
            ["local", str(ROOT / "examples" / "digits.py"), "--workers", "2", "--strategy",
             strategy, "--steps", "30", "--metrics", str(path), "--eval-every", "0.02",
             "--threads", "1", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
            timeout=100)
        assert done.returncode == 0, done.stderr[-2000:]
        paths.append(path)
    runs = [_read(p, None) for p in paths]
    assert [r.label for r in runs] == ["sync (sync, 2 workers)", "async (async, 2 workers)"]
    assert all(len(r.steps) == 30 and r.evals and r.final for r in runs)
    out = plot(paths, tmp_path / "p.png")
    pixels = _image(out)
    assert pixels.shape[:2] == (800, 1200)
    assert pixels[..., :3].std() > 0.05


@pytest.mark.timeout(60)
def test_the_plot_command_draws_and_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    import subprocess

    a = _write(tmp_path / "a.jsonl", _run_records("sync"))
    b = _write(tmp_path / "b.jsonl", _run_records("async", decay=0.2))
    root = Path(__file__).resolve().parents[2]

    def tensorbus(*args: str) -> subprocess.CompletedProcess[str]:
        return zygote.shared().run(["plot", *args], cwd=root,
                              capture_output=True, text=True, timeout=50, check=False)

    done = tensorbus(str(a), str(b), "-o", str(tmp_path / "p.png"), "--label", "sync",
                     "--label", "async")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == f"wrote {tmp_path / 'p.png'}"
    assert _image(tmp_path / "p.png").std() > 0.05
    done = tensorbus(str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "q.png"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"tensorbus: error: {tmp_path / 'none.jsonl'} does not exist: give the file that "
        "--metrics wrote"]
    assert not (tmp_path / "q.png").exists()
