"""`tensorbus plot`: one PNG figure from the --metrics files of one or more runs.

Four panels, one colour per run: training loss by version and by training time (a faint line
per step under a moving average), the evaluation figure (accuracy) by training time, and each
worker's time split into computing, communicating and waiting. Reading is strict (a file that
is not a metrics file is a one-line `PlotError`) except for a torn last line, which is what a
run killed mid-write leaves. matplotlib is optional, so it is imported only here, when drawing.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from matplotlib.axes import Axes

DPI: Final = 100
FIGSIZE: Final = (12.0, 8.0)  # inches: 1200 x 800 pixels at DPI
SMOOTH_FRACTION: Final = 20  # the moving average spans 1/20 of a run's steps
PARTS: Final = ("compute_s", "comm_s", "wait_s")
PART_NAMES: Final = ("computing", "communicating", "waiting")
PART_COLOURS: Final = ("#4c72b0", "#dd8452", "#c0c0c0")
PART_TEXT: Final = ("white", "black", "black")  # readable on each part's colour
# Eval record keys that say when the point was taken, not how good the model was.
NOT_FIGURES: Final = frozenset({"event", "wall_s", "version", "samples", "train_s"})


class PlotError(Exception):
    """The plot cannot be made; the message is one line saying what is wrong and what to do."""


@dataclass(frozen=True, kw_only=True)
class _Run:
    label: str  # in the legend
    name: str  # on its workers' bars: the label given, or the file's stem
    steps: list[tuple[float, float, float]]  # (version, train_s, loss)
    figure: str | None  # the evaluation figure plotted, "accuracy" when there is one
    evals: list[tuple[float, float]]  # (train_s, figure)
    final: tuple[float, float] | None  # the summary's figure for the final model, at its train_s
    split: dict[int, tuple[float, float, float]]  # rank -> seconds computing, communicating, waiting


def plot(paths: Sequence[Path], out: Path, *, labels: Sequence[str] | None = None) -> Path:
    """Draw the runs in `paths` (tensorbus --metrics files) into the PNG `out`; return `out`.
    Each run is labelled by `labels`, or by its file's stem, strategy and worker count."""
    out = Path(out)
    if not paths:
        raise PlotError("no metrics files given: name at least one --metrics file")
    if labels is not None and len(labels) != len(paths):
        raise PlotError(f"{len(labels)} labels for {len(paths)} files: give one label per file")
    if out.suffix.lower() != ".png":
        raise PlotError(f"{out}: the plot is a PNG, so name the output FILE.png")
    if out.is_dir():
        raise PlotError(f"{out} is a directory: name the output FILE.png")
    if not out.parent.is_dir():
        raise PlotError(f"{out.parent} does not exist: create it or write the plot elsewhere")
    runs = [_read(Path(p), None if labels is None else labels[i]) for i, p in enumerate(paths)]
    try:
        import matplotlib  # noqa: F401  (first, so that its absence is the error seen)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install 'tensorbus[plot]' "
                        "(or pip install matplotlib)") from None

    # A bare Figure on an Agg canvas: no pyplot, so the caller's backend and open figures
    # are left alone and nothing needs a display.
    figure = Figure(figsize=FIGSIZE, layout="constrained")
    FigureCanvasAgg(figure)
    by_version, by_time, evals, workers = figure.subplots(2, 2).flat
    _draw_loss(by_version, runs, time=False)
    _draw_loss(by_time, runs, time=True)
    _draw_evals(evals, runs)
    _draw_split(workers, runs)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    try:
        out.write_bytes(buffer.getvalue())
    except OSError as e:
        raise PlotError(f"cannot write {out}: {e.strerror}") from None
    return out


# Reading ---------------------------------------------------------------------------------


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each record of the file; blank lines and a torn last one skipped."""
    if not path.exists():
        raise PlotError(f"{path} does not exist: give the file that --metrics wrote")
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        raise PlotError(f"cannot read {path}: {e.strerror}") from None
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == last:  # a run killed while writing its last record
                return
            raise PlotError(f"{path} line {n} is not JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise PlotError(f"{path} line {n} is not a metrics record: expected a JSON object")
        yield n, record


def _read(path: Path, label: str | None) -> _Run:
    steps: list[tuple[float, float, float]] = []
    evals: list[dict[str, Any]] = []
    worker_sums: dict[int, list[float]] = {}
    summary: dict[str, Any] | None = None
    # A resumed run restarts its clock; its time is counted on from where the file left off.
    offset = latest = summary_offset = 0.0
    for n, record in _records(path):
        match record.get("event"):
            case "step":
                version, train_s, loss = (_number(record.get(k)) for k in
                                          ("version", "train_s", "loss"))
                if version is None or train_s is None or loss is None:
                    raise PlotError(f"{path} line {n}: a step record needs numeric version, "
                                    "train_s and loss; is this a tensorbus metrics file?")
                latest = offset + train_s
                steps.append((version, latest, loss))
            case "eval":
                evals.append({**record, "train_s": offset + (_number(record.get("train_s")) or 0.0)})
            case "worker":
                rank = _number(record.get("rank"))
                if rank is not None:
                    sums = worker_sums.setdefault(int(rank), [0.0, 0.0, 0.0])
                    for i, part in enumerate(PARTS):
                        sums[i] += max(_number(record.get(part)) or 0.0, 0.0)
            case "resume":
                offset = latest
            case "summary":
                summary, summary_offset = record, offset
            case _:
                pass  # start, lost, checkpoint, straggler: not drawn
    if not steps:
        raise PlotError(f"{path} has no step records: is it a --metrics file of tensorbus local "
                        "or coordinator?")
    figure = _figure_name(evals) or ("accuracy" if summary and "accuracy" in summary else None)
    points = [(e["train_s"], v) for e in evals
              if figure is not None and (v := _number(e.get(figure))) is not None]
    final = None
    if summary is not None and figure is not None:
        value, train_s = _number(summary.get(figure)), _number(summary.get("train_s"))
        if value is not None and train_s is not None:
            final = (summary_offset + train_s, value)
    return _Run(label=label if label is not None else _default_label(path, summary),
                name=label if label is not None else path.stem, steps=steps, figure=figure,
                evals=points, final=final,
                split=_split(summary, worker_sums))


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _figure_name(evals: Sequence[Mapping[str, Any]]) -> str | None:
    """"accuracy" if the evaluations have it, else the first figure they report."""
    if any("accuracy" in e for e in evals):
        return "accuracy"
    for e in evals:
        for key, value in e.items():
            if key not in NOT_FIGURES and _number(value) is not None:
                return key
    return None


def _default_label(path: Path, summary: Mapping[str, Any] | None) -> str:
    if summary is None:
        return path.stem
    about = [str(summary["strategy"])] if "strategy" in summary else []
    if isinstance(workers := summary.get("workers"), int):
        about.append(f"{workers} worker{'s' if workers != 1 else ''}")
    return f"{path.stem} ({', '.join(about)})" if about else path.stem


def _split(summary: Mapping[str, Any] | None,
           worker_sums: Mapping[int, list[float]]) -> dict[int, tuple[float, float, float]]:
    """Seconds computing, communicating and waiting per rank: the summary's figures where it
    has them (runs from before telemetry do not), else the sum of the worker records."""
    per_worker = summary.get("per_worker") if summary is not None else None
    split: dict[int, tuple[float, float, float]] = {}
    if isinstance(per_worker, dict):
        for rank, counters in per_worker.items():
            if isinstance(counters, dict) and str(rank).isdigit():
                compute, comm, wait = (_number(counters.get(part)) for part in PARTS)
                if compute is not None and comm is not None and wait is not None:
                    split[int(rank)] = (max(compute, 0.0), max(comm, 0.0), max(wait, 0.0))
    for rank, sums in worker_sums.items():
        split.setdefault(rank, (sums[0], sums[1], sums[2]))
    return {rank: parts for rank, parts in sorted(split.items()) if sum(parts) > 0}


# Drawing ---------------------------------------------------------------------------------


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the `window - 1` before it (fewer at the start)."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window)
            for i in range(len(values))]


def _draw_loss(ax: Axes, runs: Sequence[_Run], *, time: bool) -> None:
    for i, run in enumerate(runs):
        points = [(t if time else v, loss) for v, t, loss in run.steps if math.isfinite(loss)]
        if not points:
            continue
        xs, losses = [x for x, _ in points], [loss for _, loss in points]
        window = max(1, len(losses) // SMOOTH_FRACTION)
        ax.plot(xs, losses, color=f"C{i}", linewidth=0.7, alpha=0.25)
        ax.plot(xs, _moving_average(losses, window), color=f"C{i}", linewidth=1.8,
                label=run.label)
    ax.set_title(f"training loss by {'training time' if time else 'version'}\n"
                 "faint: each step, solid: moving average", fontsize=10)
    ax.set_xlabel("training time (s)" if time else "version (updates applied)")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if not time and ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=9)


def _draw_evals(ax: Axes, runs: Sequence[_Run]) -> None:
    names: list[str] = []
    values: list[float] = []
    for i, run in enumerate(runs):
        points = list(run.evals)
        if run.final is not None and (not points or run.final[0] >= points[-1][0]):
            points.append(run.final)  # the final model, evaluated when training stopped
        if not points or run.figure is None:
            continue
        ax.plot([t for t, _ in points], [v for _, v in points], color=f"C{i}", marker="o",
                markersize=4, linewidth=1.5, label=run.label)
        values += [v for _, v in points]
        if run.figure not in names:
            names.append(run.figure)
    if not names:
        _say(ax, "no evaluations (run with --eval-every)")
        return
    if names == ["accuracy"] and all(0.0 <= v <= 1.0 for v in values):
        from matplotlib.ticker import PercentFormatter

        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title(f"{' / '.join(names)} by training time", fontsize=10)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel(" / ".join(names))
    ax.grid(alpha=0.3)


def _draw_split(ax: Axes, runs: Sequence[_Run]) -> None:
    bars = [(f"{run.name} w{rank}", parts)
            for run in runs for rank, parts in run.split.items()]
    if not bars:
        _say(ax, "no per-worker telemetry in these files")
        return
    from matplotlib.ticker import PercentFormatter

    left = [0.0] * len(bars)
    for p, (name, colour, ink) in enumerate(zip(PART_NAMES, PART_COLOURS, PART_TEXT,
                                                strict=True)):
        shares = [parts[p] / sum(parts) for _, parts in bars]
        ax.barh(range(len(bars)), shares, left=left, color=colour, label=name)
        for y, (x, share) in enumerate(zip(left, shares, strict=True)):
            if share >= 0.08:  # a narrower segment has no room for its number
                ax.text(x + share / 2, y, f"{share:.0%}", ha="center", va="center", fontsize=8,
                        color=ink)
        left = [x + share for x, share in zip(left, shares, strict=True)]
    ax.set_yticks(range(len(bars)), [name for name, _ in bars], fontsize=9)
    ax.invert_yaxis()  # first run's first worker on top
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title("each worker's time", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=3, fontsize=9,
              frameon=False)


def _say(ax: Axes, text: str) -> None:
    """An empty panel that says why it is empty."""
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=11, color="dimgray",
            transform=ax.transAxes)
    ax.set_axis_off()
