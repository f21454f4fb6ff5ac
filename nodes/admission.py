"""Who a coordinator lets into its run, and how it answers everyone else.

- `refusal`: whether a Join is refused for its build or its model's layout, and why, in
  words that say what to do (a taken or unknown rank is nodes.membership's to judge).
- `welcome`: what an admitted worker is told: its rank, the strategy's rhythm, the run's
  settings, and where its data had got to.
- `Rejections`: every message refused or rejected is counted (the summary's `rejected`)
  and logged at most once a peer, code and 10 s, so that a hostile or confused peer
  cannot flood the log; connections that left cleanly are remembered (their last beats
  are not refused); and what strangers can make it remember stays bounded.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from tensorbus.bus.clock import Clock
from tensorbus.bus.messages import BUILD, Describe, Join, RejectCode, Welcome
from tensorbus.bus.shared import HostToken
from tensorbus.nodes.config import CoordinatorConfig
from tensorbus.nodes.description import ModelShell
from tensorbus.nodes.metrics import Metrics
from tensorbus.nodes.shards import ShardModel
from tensorbus.strategies.base import Strategy

log = logging.getLogger("tensorbus.coordinator")

UNKNOWN_BUILD = "unknown"  # a build that cannot tell its release (or none said): not judged
NOT_A_MEMBER = "not a member: join first (or again, if removed)"
_QUIET_S = 10.0  # a peer's rejections of one code are logged at most once this often


@dataclass(frozen=True)
class Refusal:
    code: RejectCode
    detail: str


def refusal(join: Join | Describe, *, layout: str, model: object,
            stage: tuple[int, int] = (0, 1)) -> Refusal | None:
    """Why `join` (or a script's Describe) is refused for its build, its pipeline stage
    (`stage`: ours, of how many) or its layout (`layout`: ours), or None."""
    if join.build not in ("", UNKNOWN_BUILD, BUILD) and BUILD != UNKNOWN_BUILD:
        return Refusal(RejectCode.BUILD, f"the worker runs tensorbus {join.build}, the "
                                         f"coordinator {BUILD}: install the same release on both")
    asked = (join.stage, join.stages) if isinstance(join, Join) else (0, 1)
    if asked != stage:
        # (Before the layout: stages of one model may have one layout, identical blocks say.)
        def said(s: tuple[int, int]) -> str:
            return "the whole model" if s == (0, 1) else f"stage {s[0]} of {s[1]}"
        return Refusal(RejectCode.LAYOUT, (
            f"this coordinator serves {said(stage)}, and the worker holds {said(asked)}: "
            "connect each stage's workers to that stage's coordinator, with the same "
            "--pipeline everywhere"))
    if join.layout == layout:
        return None
    if isinstance(model, ShardModel):
        return Refusal(RejectCode.LAYOUT, (
            f"this coordinator is shard {model.index} of {model.count} (layout {layout}) and "
            f"the worker asked for layout {join.layout}: give the worker every shard's "
            "address in shard order (--connect ADDR0,ADDR1,...), and the same SPEC everywhere"))
    if isinstance(join, Describe) or isinstance(model, ModelShell):
        return Refusal(RejectCode.LAYOUT, (
            f"this script's model (layout {join.layout}) is not the run's (layout {layout}, "
            "from the first rank that described it): every rank must build the same model"))
    return Refusal(RejectCode.LAYOUT, f"worker model layout {join.layout} differs from the "
                                      f"coordinator's {layout}: both must load the same SPEC")


def welcome(join: Join, rank: int, *, strategy: Strategy, config: CoordinatorConfig,
            world_size: int, pub_port: int, lr: float, position: int,
            host_token: HostToken | None, standby: str = "", run: str = "") -> Welcome:
    """The Welcome of worker `rank`, admitted for `join` (its weights go with it, sent by
    nodes.publisher). `host_token`: ours, offered to a worker of this host (bus.shared);
    `standby`: where our standby serves ("": none); `run`: the run's id."""
    rhythm = strategy.rhythm
    return Welcome(
        request=join.request, rank=rank, world_size=world_size, strategy=strategy.name,
        push=rhythm.push.value, local_steps=rhythm.local_steps, wait=rhythm.wait.value,
        batch_size=config.batch_size, pub_port=pub_port, heartbeat_s=config.heartbeat_s,
        timeout_s=config.timeout_s, lr=lr, position=position, compress=config.compress,
        shared=(host_token.offer if host_token is not None and join.shared and HostToken.seen(join.shared)
                else ""),
        seed=config.seed, clip_grad_norm=config.clip_grad_norm or 0.0,
        precision=config.precision, standby=standby, run=run, fragments=rhythm.fragments, mix=rhythm.mix,
        micro_batches=config.micro_batches if config.pipeline > 1 else 1,
        schedule=config.schedule if config.pipeline > 1 else "",
    )


class Rejections:
    def __init__(self, metrics: Metrics, clock: Clock, *, workers: int) -> None:
        self._metrics = metrics
        self._clock = clock
        self._kept = 4 * workers + 64  # clean departures remembered
        self._warned: dict[tuple[bytes, str], float] = {}
        self._departed: dict[bytes, None] = {}  # connections that left cleanly, oldest first

    def count(self, peer: bytes, code: str, text: str) -> None:
        """A message of `peer` refused or rejected with `code`: counted, and `text` logged
        unless this peer's `code` was logged in the last 10 s."""
        self._metrics.rejected[code] += 1
        self.warn(peer, code, text)

    def warn(self, peer: bytes, code: str, text: str) -> None:
        """Log `text`, at most once a peer, code and 10 s."""
        now = self._clock.monotonic()
        if now - self._warned.get((peer, code), -math.inf) >= _QUIET_S:
            self._warned[(peer, code)] = now
            log.warning("%s (further ones like it from this peer: counted, not logged, for 10 s)", text)

    def left(self, peer: bytes) -> None:
        """`peer` left cleanly: beats it sent before its Leave was taken are not refused."""
        self._departed[peer] = None

    def departed(self, peer: bytes) -> bool:
        return peer in self._departed

    def handshakes(self, refused: int) -> None:
        """Say connections refused for their keys as they come (`refused`: the transport's
        count so far): a worker started without --keys, or with a pair this coordinator
        does not hold, is told nothing."""
        said = self._metrics.rejected["handshake"]
        if refused > said:
            log.warning("refused %d connection(s) for their keys (%d in all): this "
                        "coordinator admits only the workers whose public keys are in "
                        "--keys DIR/authorized; start each with --keys DIR --key-name NAME",
                        refused - said, refused)
            self._metrics.rejected["handshake"] = refused

    def forget(self, now: float) -> None:
        """Bound what strangers can make us remember: connections come and go (each
        reconnection is a new identity), and these maps must not grow with them."""
        self._warned = {k: t for k, t in self._warned.items() if now - t < _QUIET_S}
        while len(self._departed) > self._kept:
            self._departed.pop(next(iter(self._departed)))
