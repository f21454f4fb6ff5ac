"""What `local`, `coordinator` and `relay` print when a run ends: a few lines of its main
figures (the whole summary is the last line of --metrics, and `--json` prints it instead),
and, for a run stopped by a signal, what was saved and how to go on."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

# The summary's own fields (nodes.metrics); any other name is a figure of evaluate()'s.
_FIELDS = {"event", "strategy", "workers", "steps", "samples", "wall_s", "train_s",
           "final_loss", "dropped", "rejected", "max_staleness", "max_clock_gap", "broadcasts",
           "lost", "failed", "ended", "resumed_from", "stopped_by", "checkpoint", "per_worker",
           "unused", "pipeline", "standby"}


def table(summary: dict[str, Any], metrics: Path | None, *, keeps: bool = True) -> str:
    """The summary's main figures, a few short lines; `keeps`: the command has --metrics."""
    loss = summary.get("final_loss")
    lines = [
        f"{summary['strategy']}, {summary['workers']} workers: {summary['steps']} versions, "
        f"{summary['samples']} samples in {summary['train_s']:.1f} s of training "
        f"({summary['wall_s']:.1f} s in all)",
        f"  final loss   {loss:.4f}" if isinstance(loss, float) else "  final loss   -",
    ]
    figures = {k: v for k, v in summary.items() if k not in _FIELDS}
    for name, value in figures.items():
        lines.append(f"  {name:<12} {value:.4f}" if isinstance(value, float)
                     else f"  {name:<12} {value}")
    dropped = ", ".join(f"{n} {why}" for why, n in summary["dropped"].items() if n) or "none"
    lost = ", ".join(f"worker {w['rank']}" for w in summary["lost"]) or "none"
    lines.append(f"  dropped      {dropped}")
    lines.append(f"  lost         {lost}")
    for worker in summary.get("failed") or []:  # (said only where one failed: rare)
        lines.append(f"  failed       worker {worker['rank']} at version {worker['version']}: "
                     f"{worker['why']}")
    if summary.get("max_clock_gap"):
        lines.append(f"  staleness    at most {summary['max_staleness']} versions, clocks at "
                     f"most {summary['max_clock_gap']} apart")
    if summary.get("unused"):
        lines.append(f"  unused       {summary['unused']} samples an epoch (the last partial "
                     "global batch)")
    lines += _pipeline(summary.get("pipeline"))
    lines += _standby(summary.get("standby"))
    lines.append(f"  ended        {summary['ended'] or '-'}")
    if metrics is not None:
        lines.append(f"  every step and the whole summary: {metrics}")
    elif keeps:
        lines.append("  (--metrics FILE.jsonl keeps every step and the whole summary)")
    return "\n".join(lines)


def _standby(section: Any) -> list[str]:
    """A run that had a standby coordinator (nodes.replication.Standbys.summary)."""
    if not isinstance(section, dict):
        return []
    took = (f"took the run over (term {section['term']}); " if section["term"] else "")
    replicas = section["replicated"]
    each = 1e3 * section["replicate_s"] / replicas if replicas else 0.0
    return [f"  standby      {took}{replicas} versions replicated, {each:.1f} ms each"
            + (" (weights by reference)" if section.get("by_reference") else "")]


def _pipeline(section: Any) -> list[str]:
    """A pipelined run's lines (run.pipelines.figures): its shape, its bubble, each stage."""
    if not isinstance(section, dict):
        return []
    measured = section.get("bubble")
    lines = [f"  pipeline     {section['pipelines']} of {section['stages']} stages, "
             f"{section['micro_batches']} micro-batches, {section['schedule']}: bubble "
             + (f"{measured:.2f}" if isinstance(measured, float) else "-")
             + f" ((P-1)/(M+P-1) = {section['bubble_formula']:.2f})"]
    for stage in section["per_stage"]:
        busy = stage["busy_s"] / stage["span_s"] if stage["span_s"] > 0 else 0.0
        lines.append(f"  stage {stage['stage']:<6} {stage['parameters']} parameters, peak memory "
                     f"{stage['peak_bytes'] / 2**20:.0f} MB, busy {busy:.0%} of its steps, "
                     f"{stage['held']} micro-batch(es) held at most"
                     + (f", lost worker(s) {', '.join(map(str, stage['lost']))}"
                        if stage.get("lost") else ""))
    return lines


def stopped_by(summary: dict[str, Any]) -> signal.Signals | None:
    """The signal that stopped the run before its end, if one did."""
    name = summary.get("stopped_by")
    return signal.Signals[name] if isinstance(name, str) and name in signal.Signals.__members__ \
        else None


def after_a_signal(summary: dict[str, Any], *, saves: bool = True) -> str:
    """One line for a run a signal stopped: where it stopped, what was saved, how to go on
    (`saves`: the command has --checkpoint-dir; a relay keeps no state of its own)."""
    stopped = f"stopped by {summary['stopped_by']} at version {summary['steps']}"
    if not saves:
        return stopped
    where = (f"checkpoint {summary['checkpoint']}: run the same command with --resume to "
             "go on" if summary.get("checkpoint") else
             "nothing was saved (--checkpoint-dir DIR keeps a run's state)")
    return f"{stopped}: {where}"
