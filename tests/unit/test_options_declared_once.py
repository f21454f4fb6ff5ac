"""Unit: an option is declared once, as a flag in run.flags; RunOptions and the
coordinator's configuration are filled from it by name, so none is left behind."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tensorbus.bus.security import ServerKeys, make_keys
from tensorbus.nodes.config import CoordinatorConfig
from tensorbus.run import flags, own_loop
from tensorbus.run.options import NODE_SETTINGS, RunOptions, coordinator_config, same_named

pytestmark = pytest.mark.timeout(30)

BIND = "tcp://127.0.0.1:0"
OPTIONS = {f.name: f for f in dataclasses.fields(RunOptions)}
CONFIG = {f.name for f in dataclasses.fields(CoordinatorConfig)}


def _command(name: str) -> argparse.ArgumentParser:
    (commands,) = [a for a in flags.parser()._actions
                   if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def _dests(name: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in _command(name)._actions}


def _options(*argv: str) -> RunOptions:
    return RunOptions.from_args(flags.parser().parse_args(["local", "s.py", *argv]))


def test_every_run_option_is_fed_by_a_flag_of_its_name_or_by_to_options() -> None:
    unfed = set(OPTIONS) - set(_dests("local")) - set(flags.TO_OPTIONS)
    assert not unfed, f"RunOptions fields no flag of `local` sets: {sorted(unfed)}"
    assert set(flags.TO_OPTIONS) <= set(OPTIONS)


@pytest.mark.parametrize("command", ["local", "coordinator"])
def test_every_flag_of_a_training_run_feeds_a_run_option_or_is_listed(command: str) -> None:
    dests = set(_dests(command))
    stray = dests - set(OPTIONS) - flags.NOT_OPTIONS
    assert not stray, f"flags of `{command}` that set no RunOptions field: {sorted(stray)}"
    assert not flags.NOT_OPTIONS & set(OPTIONS)


def test_not_options_lists_only_dests_that_exist() -> None:
    assert flags.NOT_OPTIONS <= set(_dests("local")) | set(_dests("coordinator"))


def test_a_flag_s_default_is_its_run_option_s() -> None:
    for dest, action in _dests("local").items():
        if dest in OPTIONS and dest not in flags.TO_OPTIONS and action.default is not None:
            assert action.default == OPTIONS[dest].default, dest


def test_a_flag_has_one_dest_on_every_command() -> None:
    (commands,) = [a for a in flags.parser()._actions
                   if isinstance(a, argparse._SubParsersAction)]
    seen: dict[str, str] = {}
    for sub in commands.choices.values():
        for action in sub._actions:
            for option in action.option_strings:
                assert seen.setdefault(option, action.dest) == action.dest, option


def test_every_coordinator_setting_is_a_run_option_or_a_node_s_own() -> None:
    assert CONFIG - set(OPTIONS) == NODE_SETTINGS
    assert not NODE_SETTINGS & set(OPTIONS)


def test_the_defaults_of_a_command_line_are_the_defaults_of_the_settings() -> None:
    options = _options("--workers", "2")
    assert options == RunOptions(workers=2)
    assert coordinator_config(options, bind=BIND) == CoordinatorConfig(bind=BIND, epochs=1)


def test_a_local_command_line_reaches_the_options_and_the_config() -> None:
    options = _options("--workers", "3", "--strategy", "ssp", "--staleness", "4",
                       "--staleness-lr", "--steps", "9", "--heartbeat", "0.25",
                       "--timeout", "3", "--join-timeout", "7", "--min-workers", "2",
                       "--max-workers", "5", "--eval-every", "5.0", "--no-shared-memory",
                       "--compress", "bf16", "--precision", "bf16-mixed", "--seed", "11",
                       "--fault", "slow:1:5", "--clip-grad-norm", "2.5")
    assert options == RunOptions(
        workers=3, strategy="ssp", strategy_options={"staleness": 4, "staleness_lr": True},
        steps=9, heartbeat_s=0.25, timeout_s=3.0, join_timeout_s=7.0, min_workers=2,
        max_workers=5, eval_every_s=5.0, shared_memory=False, compress="bf16",
        precision="bf16-mixed", seed=11, faults=("slow:1:5",), clip_grad_norm=2.5)
    config = coordinator_config(options, bind=BIND, pub_port=7001)
    assert config == CoordinatorConfig(
        bind=BIND, pub_port=7001, steps=9, heartbeat_s=0.25, timeout_s=3.0,
        join_timeout_s=7.0, min_workers=2, max_workers=5, eval_every_s=5.0,
        shared_memory=False, compress="bf16", precision="bf16-mixed", seed=11,
        clip_grad_norm=2.5)


def test_eval_every_in_epochs_and_the_strategy_s_options() -> None:
    options = _options("--workers", "2", "--strategy", "average", "--average-every", "4",
                       "--outer-lr", "0.7", "--outer-momentum", "0.9", "--nesterov",
                       "--epochs", "3", "--eval-every", "2ep")
    assert (options.eval_every_s, options.eval_every_epochs) == (None, 2)
    assert options.strategy_options == {"average_every": 4, "outer_lr": 0.7,
                                        "outer_momentum": 0.9, "nesterov": True}
    config = coordinator_config(options, bind=BIND)
    assert (config.steps, config.epochs) == (None, 3)
    assert (config.eval_every_s, config.eval_every_epochs) == (None, 2)
    assert config.shared_memory


def test_a_shard_s_config_has_its_own_files(tmp_path: Path) -> None:
    argv = ["coordinator", "s.py", "--workers", "2", "--shard", "1/2", "--metrics", "m.jsonl",
            "--trace", "t.json", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "5"]
    options = RunOptions.from_args(flags.parser().parse_args(argv))
    assert options.shards == 2
    first, second = (coordinator_config(options, bind=BIND, shard=i, shards=2) for i in (0, 1))
    assert (first.metrics, first.trace) == (Path("m.jsonl"), Path("t.json"))
    assert (second.metrics, second.trace) == (None, None)
    assert second.checkpoint_dir == tmp_path / "shard-1-of-2"
    assert second.checkpoint_every == 5


def test_keys_are_read_from_their_directory(tmp_path: Path) -> None:
    make_keys(tmp_path, ["worker"])
    config = coordinator_config(_options("--workers", "2", "--keys", str(tmp_path)), bind=BIND)
    assert isinstance(config.keys, ServerKeys)


def test_a_relay_s_settings_are_copied_by_name() -> None:
    args = flags.parser().parse_args(
        ["relay", "s.py", "--connect", "tcp://127.0.0.1:1", "--bind", BIND, "--workers", "2",
         "--heartbeat", "0.2", "--timeout", "2", "--join-timeout", "9", "--no-shared-memory",
         "--pub-port", "7001"])
    copied: dict[str, Any] = same_named(CoordinatorConfig, args)
    assert copied == {"bind": BIND, "pub_port": 7001, "heartbeat_s": 0.2, "timeout_s": 2.0,
                      "join_timeout_s": 9.0, "keys": None, "shared_memory": False}


def test_a_pipeline_command_line_reaches_each_stage_s_config(tmp_path: Path) -> None:
    options = _options("--workers", "8", "--pipeline", "4", "--micro-batches", "4",
                       "--schedule", "gpipe", "--checkpoint-dir", str(tmp_path), "--steps", "3")
    assert (options.pipeline, options.micro_batches, options.schedule) == (4, 4, "gpipe")
    assert options.pipelines == 2  # (each stage's coordinator serves one worker a pipeline)
    second = coordinator_config(options, bind=BIND, stage=1)
    assert (second.pipeline, second.stage, second.micro_batches, second.schedule) == (4, 1, 4, "gpipe")
    assert second.checkpoint_dir == tmp_path / "stage-1-of-4"
    assert (second.metrics, coordinator_config(options, bind=BIND).stage) == (None, 0)


def test_streaming_options_reach_the_strategy_and_refuse_what_splits_the_model() -> None:
    options = _options("--workers", "2", "--strategy", "average", "--average-every", "8",
                       "--fragments", "4", "--fragment-mix", "0.25", "--compress", "int4")
    assert options.strategy_options == {"average_every": 8, "fragments": 4, "fragment_mix": 0.25}
    for split in (["--shards", "2"], ["--colocate"]):
        with pytest.raises(ValueError, match="^--fragments streams the averages of the whole "
                                             "model through one coordinator"):
            _options("--workers", "2", "--strategy", "average", "--fragments", "2", *split)


def test_a_script_s_own_loop_refuses_fragments() -> None:
    options = RunOptions(workers=2, strategy="average", strategy_options={"fragments": 2})
    with pytest.raises(ValueError, match="^--fragments: a script's own loop pushes the whole "
                                         "model at each average"):
        own_loop.check(options)
