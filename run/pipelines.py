"""`local --pipeline P`: a coordinator a stage here, and the stage workers as processes.

The SPEC's `stages()`, built here once with the run's seed, is cut into P consecutive
stages (nodes.stages). Each stage gets a coordinator of its own, serving that stage's
parameters under the run's strategy to the same stage of every pipeline: `--workers N`
makes D = N/P pipelines, and worker W is stage W mod P of pipeline W div P, which joins
its stage's coordinator as rank W div P (nodes.stage_worker). The coordinators share a
directory of where each stage worker listens (nodes.pipeline_directory), from which the
stages of a pipeline find each other. Only stage 0's coordinator writes the metrics, shows
progress and evaluates: the whole model, every stage's modules in order (`whole`), which
`--save` writes too.

A pipeline stops as a whole (`Pipelines.stop`): when one of its workers dies or fails (its
process ends, said by its relay here) or is lost by its coordinator (silent), the line
names the stage, the pipeline and the worker; the pipeline's other workers are told to
leave (SIGTERM), and every stage coordinator goes on without that rank. The others train on, a pipeline
fewer; with fewer pipelines left than `--min-workers` (1), the run fails with that line.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch

from tensorbus.bus.shared import sweep
from tensorbus.nodes.coordinator import Coordinator, Progress
from tensorbus.nodes.pipeline_directory import PipelineDirectory
from tensorbus.nodes.pipeline_order import bubble
from tensorbus.nodes.stages import Stage, StagesError, call_stages, cut, parameters_of, whole
from tensorbus.run.children import Forks, spawn
from tensorbus.run.export import save_model
from tensorbus.run.faults import parse_local
from tensorbus.run.local import (
    ERROR_PREFIX,
    REAP_TIMEOUT_S,
    LocalRunError,
    Process,
    _reap,
    threads_per_worker,
)
from tensorbus.run.options import RunOptions, coordinator_config, make_strategy
from tensorbus.run.signals import stopping_on_signals
from tensorbus.run.spec import Spec, SpecError, load_spec
from tensorbus.run.status import StatusTable

log = logging.getLogger("tensorbus.local")


def stage_models(spec: Spec, options: RunOptions) -> list[Stage]:
    """The SPEC's stages(), seeded with --seed, cut into --pipeline stages."""
    source = f"SPEC {spec.source}"
    if spec.stages is None:
        raise SpecError(f"{source}: --pipeline {options.pipeline} needs stages() -> list of "
                        "torch.nn.Module, the model cut into modules that run in sequence: "
                        "define it (see examples/digits_pipeline.py)")
    torch.manual_seed(options.seed)
    try:
        stages = cut(call_stages(spec.stages, source), options.pipeline, source)
    except StagesError as e:
        raise SpecError(str(e)) from e.__cause__
    for s, stage in enumerate(stages):
        if parameters_of(stage) == 0:
            raise SpecError(f"{source}: stage {s} of {options.pipeline} has no parameters to "
                            "train: give stages() more modules with parameters, or a shorter "
                            "--pipeline")
    return stages


def make_stage_coordinators(
    spec: Spec, options: RunOptions, *, bind: str,
    on_step: Callable[[Progress], None] | None = None,
    on_lost: Callable[[int, int, str], Any] | None = None,
) -> list[Coordinator]:
    """A coordinator a stage of --pipeline, sharing one directory. `on_lost(stage, rank,
    why)` is awaited when a stage's coordinator loses a worker."""
    options.check_spec(spec)
    stages = stage_models(spec, options)
    directory = PipelineDirectory(options.pipeline)
    evaluate = spec.evaluate
    model = whole(stages)

    def assembled(_: torch.nn.Module) -> dict[str, float]:
        """evaluate() on the whole model, every stage in eval mode (the first stage's alone
        is the coordinator's: nodes.evalpoints sets it), each mode given back after."""
        assert evaluate is not None
        modes = [m.training for m in model.modules()]
        model.eval()
        try:
            return evaluate(model)
        finally:
            for module, mode in zip(model.modules(), modes, strict=True):
                module.training = mode

    def lost(stage: int) -> Callable[[int, str], Any] | None:
        if on_lost is None:
            return None

        async def said(rank: int, why: str) -> None:
            await on_lost(stage, rank, why)
        return said

    coordinators = [Coordinator(
        model=stage, strategy=make_strategy(options),
        config=coordinator_config(options, bind=bind, stage=s),
        optimizer=spec.optimizer, scheduler=spec.scheduler, lr=options.sgd_lr,
        evaluate=assembled if s == 0 and evaluate is not None else None,
        on_step=on_step if s == 0 else None, directory=directory, on_lost=lost(s),
    ) for s, stage in enumerate(stages)]
    coordinators[0].metrics.workers = options.workers  # (its summary's: every process's)
    return coordinators


def figures(options: RunOptions, coordinators: list[Coordinator]) -> dict[str, Any]:
    """The summary's "pipeline" section: each stage's size, peak memory, busy time,
    activations held and workers lost, and the bubble measured beside (P - 1) / (M + P - 1)."""
    per_stage: list[dict[str, Any]] = []
    spans: list[float] = []
    busy = 0.0
    for s, c in enumerate(coordinators):
        workers = c.metrics.per_worker.values()
        spans.append(sum(w.get("span_s", 0.0) for w in workers))
        busy += sum(w.get("busy_s", 0.0) for w in workers)
        per_stage.append({
            "stage": s,
            "parameters": parameters_of(c.model),
            "peak_bytes": max((int(w["peak_bytes"]) for w in workers), default=0),
            "held": max((int(w.get("held", 0)) for w in workers), default=0),
            "busy_s": round(sum(w.get("busy_s", 0.0) for w in workers), 6),
            "span_s": round(sum(w.get("span_s", 0.0) for w in workers), 6),
            "lost": [w["rank"] for w in c.metrics.lost],  # (the summary's own: stage 0's)
        })
    # Each stage's compute against the first stage's span, which is the whole pipeline's
    # step: the share of stage-seconds idle.
    span = spans[0]
    return {
        "stages": options.pipeline, "pipelines": options.pipelines,
        "micro_batches": options.micro_batches, "schedule": options.schedule,
        "bubble": round(1 - busy / (options.pipeline * span), 4) if span > 0 else None,
        "bubble_formula": round(bubble(options.pipeline, options.micro_batches), 4),
        "per_stage": per_stage,
    }


async def serve_stages(options: RunOptions, coordinators: list[Coordinator]) -> dict[str, Any]:
    """Run every stage's coordinator to the end; stage 0's summary, with the pipeline's
    figures (written to --metrics too). One stage failing stops the others."""
    first, *others = coordinators
    rest = [asyncio.create_task(c.run()) for c in others]
    gathered = asyncio.gather(*rest)

    async def the_others() -> None:
        await gathered
        first.metrics.sections["pipeline"] = figures(options, coordinators)

    before = asyncio.create_task(the_others())
    main = asyncio.create_task(first.run(before_evaluate=before))
    try:
        both: set[asyncio.Future[Any]] = {main, gathered}
        await asyncio.wait(both, return_when=asyncio.FIRST_EXCEPTION)
        if gathered.done() and not gathered.cancelled() and gathered.exception() is not None:
            raise gathered.exception()  # type: ignore[misc]
        return await main
    finally:
        for task in (main, before, *rest):
            task.cancel()
        await asyncio.gather(main, before, gathered, *rest, return_exceptions=True)


class Pipelines:
    """The run's pipelines: which are live, and how one stops."""

    def __init__(self, options: RunOptions, failure: asyncio.Future[str]) -> None:
        self._options = options
        self._failure = failure
        self.coordinators: list[Coordinator] = []
        self.processes: dict[tuple[int, int], Process] = {}  # (pipeline, stage) -> its worker
        self.stopped: set[int] = set()
        self.reaping: list[asyncio.Task[None]] = []  # the workers of pipelines stopped

    def worker(self, pipeline: int, stage: int) -> int:
        """Its index among `local`'s workers (what --fault names)."""
        return pipeline * self._options.pipeline + stage

    async def lost(self, stage: int, pipeline: int, why: str) -> None:
        """A stage's coordinator lost this worker (silent, or killed)."""
        await self.stop(pipeline, stage, f"was lost by its coordinator ({why})")

    async def stop(self, pipeline: int, stage: int, why: str) -> None:
        """Stop `pipeline`, whose worker of `stage` `why`; fail the run if too few are left."""
        if pipeline in self.stopped or self._failure.done():
            return
        self.stopped.add(pipeline)
        left = self._options.pipelines - len(self.stopped)
        line = (f"stage {stage} of pipeline {pipeline} (worker {self.worker(pipeline, stage)}) "
                f"{why}: pipeline {pipeline} stopped")
        if left < self._options.min_workers:
            self._failure.set_result(
                f"{line}, and no pipeline is left" if left == 0 else
                f"{line}, and {left} pipeline(s) are left, fewer than --min-workers "
                f"{self._options.min_workers}")
            return
        log.warning("%s; %d pipeline(s) go on", line, left)
        # Its other workers are told to leave (SIGTERM), and do at once, each telling its
        # coordinator; one that does not is killed, and removed as it ends (`ended`).
        await self.coordinators[stage].remove(pipeline, f"{why}: removed with its pipeline")
        ours = [p for (d, _), p in self.processes.items() if d == pipeline]
        # (Kept, so that it is not collected while it runs, and awaited as the run ends.)
        self.reaping.append(asyncio.get_running_loop().create_task(_reap(ours, timeout=0.0)))

    async def ended(self, pipeline: int, stage: int, why: str) -> None:
        """A worker's process ended before the run did: its pipeline stops (or has)."""
        if pipeline not in self.stopped:
            await self.stop(pipeline, stage, why)
        elif not self._failure.done():  # (one that left has left; one killed is removed)
            await self.coordinators[stage].remove(pipeline, f"left with pipeline {pipeline}")


async def launch_pipelines(
    spec_source: str, options: RunOptions, on_step: Callable[[Progress], None] | None,
    threads: int | None, log_level: str, status: StatusTable | None, debug: bool,
    devices: list[str], forks: Forks | None,
) -> dict[str, Any]:
    """`local --pipeline P`: as run.local's launch, with a coordinator a stage."""
    spec = load_spec(spec_source)
    failure: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    pipelines = Pipelines(options, failure)
    coordinators = make_stage_coordinators(spec, options, bind="tcp://127.0.0.1:0",
                                           on_step=on_step, on_lost=pipelines.lost)
    pipelines.coordinators = coordinators
    endpoints = [c.bind() for c in coordinators]
    per_worker = threads_per_worker(threads, options.workers)
    faults = parse_local(options.faults, options.workers)
    workers: list[Process] = []
    relays = []
    try:
        for index in range(options.workers):
            pipeline, stage = divmod(index, options.pipeline)
            extra = [f"--fault={f}" for f in faults.get(index, [])]
            if debug:
                extra.append("--debug")
            if not options.shared_memory:
                extra.append("--no-shared-memory")
            argv = ["worker", spec_source, "--connect", endpoints[stage], "--rank", str(pipeline),
                    "--stage", f"{stage}/{options.pipeline}", "--threads", str(per_worker),
                    "--log-level", log_level, "--device", devices[index], *extra]
            name = f"tb stage {stage} pipeline {pipeline}"
            process = (await forks.start(name, "tensorbus", argv) if forks is not None
                       else await spawn(argv))
            workers.append(process)
            pipelines.processes[(pipeline, stage)] = process
            relays.append(asyncio.create_task(_relay(pipeline, stage, process, pipelines)))
        run = serve_stages(options, coordinators)
        if status is not None:
            run = status.around(coordinators[0], run)
        training = asyncio.create_task(stopping_on_signals(_AllStages(coordinators), run))
        either: set[asyncio.Future[Any]] = {training, failure}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if failure.done():
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
            raise LocalRunError(failure.result())
        summary = training.result()
        await _reap(workers, timeout=REAP_TIMEOUT_S)
        await asyncio.wait(relays, timeout=REAP_TIMEOUT_S)
        if failure.done():
            raise LocalRunError(failure.result())
        if options.save is not None:
            save_model(whole([c.model for c in coordinators]), options.save)
        return summary
    finally:
        await _reap(workers, timeout=0.0)
        await asyncio.gather(*pipelines.reaping, return_exceptions=True)
        for relay in relays:
            relay.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        if any(p.returncode != 0 for p in workers):
            sweep()


class _AllStages:
    """Every stage's coordinator, stopped by a signal at one version: the newest any has
    made (the others are at most a step behind, their pushes for it under way), so that the
    checkpoints and the model saved are of one step."""

    def __init__(self, coordinators: list[Coordinator]) -> None:
        self._coordinators = coordinators

    def request_stop(self, why: str) -> None:
        at = max(c.version for c in self._coordinators)
        for c in self._coordinators:
            c.request_stop(why, at_version=at)


async def _relay(pipeline: int, stage: int, process: Process, pipelines: Pipelines) -> None:
    """Copy a stage worker's output to our stderr; if it ends before the run does, stop
    its pipeline, with its last word."""
    output = process.stderr if process.stderr is not None else process.stdout
    assert output is not None
    last_error = ""
    tail: list[str] = []
    async for raw in output:
        line = raw.decode(errors="replace").rstrip()
        if line.startswith(ERROR_PREFIX):
            last_error = line[len(ERROR_PREFIX):]
            continue
        tail = (tail + [line])[-5:]
        if line.startswith(f"worker {pipeline} done: "):
            continue
        print(f"[stage {stage} of pipeline {pipeline}] {line}", file=sys.stderr, flush=True)
    code = await process.wait()
    if code != 0:
        sweep()  # (what it had in shared memory, if it could not unlink it itself)
    if code == 0 or any(c.failed for c in pipelines.coordinators):
        return  # (it ended with the run; or the run failed, which says why)
    why = (f"was killed by {signal.Signals(-code).name}" if code < 0 else
           f"failed (exit status {code}): {last_error or (tail[-1] if tail else 'no message')}")
    await pipelines.ended(pipeline, stage, why)
