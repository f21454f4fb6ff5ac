"""What a worker that streams its averages keeps beside its model, and the arithmetic on it.

Under streaming averaging (average with fragments: strategies.average) the model a worker
trains is never one version: each fragment of it has moved on locally since that
fragment's last average came back. So the worker keeps the newest version's weights whole
(`newest`), which the versions it receives are loaded into (a Fragment writes one fragment
of them: nodes.version_chain), and from which it measures what its local steps changed:

- `fill(i)`: fragment i's push. Quantized (`--compress int8|int4`), its change since the
  newest version, newest - local, plus what earlier pushes of it left out (error
  feedback), block-quantized (bus.quantize); else the fragment's local weights, copied
  (the model computes on while the push travels). The coordinator holds that version and
  takes the change from it, as under average (nodes.master).
- `mix_in(fragments)`: once their averages have come back (loaded into `newest`), each
  fragment's local weights become `mix` of themselves plus (1 - mix) of the average
  (Douillard et al. 2025's merge of local and global weights).
- `restart()`: the model becomes the newest version, as at a join (after a push that was
  not taken: its fragment was averaged without it).

Everything here runs on the compute thread, between computes (nodes.streaming). Made once
a session: the residuals start at zero again after a rejoin, as an Outbox's do.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tensorbus.bus.layout import Shard
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.outbox import quantize_change, quantized_part

Buffers = tuple[torch.Tensor, ...]


class Fragments:
    def __init__(self, flat: FlatModel, fragments: tuple[Shard, ...], *, bits: int | None,
                 mix: float) -> None:
        """`flat`: the worker's model, holding the version it was welcomed with."""
        self._flat = flat
        self.fragments = fragments
        self._bits = bits
        self._mix = mix
        with torch.no_grad():
            self.newest: Buffers = tuple(w.detach().clone() for w in flat.weights)
        device, host = flat.device, torch.device("cpu")
        if bits is not None:
            self._residual: Buffers = tuple(torch.zeros_like(w, dtype=torch.float32)
                                            for w in flat.weights)
            # Quantized where the weights are; on a GPU, copied to the host parts to be sent.
            self.parts = [quantized_part(f, bits, host) for f in fragments]
            self._made = (self.parts if device.type == "cpu"
                          else [quantized_part(f, bits, device) for f in fragments])
        else:
            self.parts = [tuple(torch.empty(s.numel, dtype=flat.weights[s.bucket].dtype)
                                for s in f.spans) for f in fragments]

    def fill(self, index: int) -> None:
        """Make fragment `index`'s push ready to send (see the module's docstring)."""
        weights, bits = self._flat.weights, self._bits
        spans = self.fragments[index].spans
        part = self.parts[index]
        with torch.no_grad():
            if bits is None:
                for out, s in zip(part, spans, strict=True):
                    out.copy_(weights[s.bucket][s.start:s.stop])
                return
            made = self._made[index]
            for n, s in enumerate(spans):
                quantize_change(self.newest[s.bucket][s.start:s.stop],
                                weights[s.bucket][s.start:s.stop],
                                self._residual[s.bucket][s.start:s.stop],
                                made[2 * n], made[2 * n + 1], bits)
            if part is not made:
                for host, device in zip(part, made, strict=True):
                    host.copy_(device)

    def mix_in(self, fragments: Iterable[int]) -> None:
        """These fragments' averages, loaded into `newest`, mixed into the model."""
        weights, mix = self._flat.weights, self._mix
        with torch.no_grad():
            for index in fragments:
                for s in self.fragments[index].spans:
                    local = weights[s.bucket][s.start:s.stop]
                    average = self.newest[s.bucket][s.start:s.stop]
                    if mix:
                        local.mul_(mix).add_(average, alpha=1.0 - mix)
                    else:
                        local.copy_(average)

    def restart(self) -> None:
        """The model becomes the newest version whole."""
        with torch.no_grad():
            for local, newest in zip(self._flat.weights, self.newest, strict=True):
                local.copy_(newest)


def changed_between(older: int, newer: int, fragments: int) -> list[int]:
    """The fragments whose averages made versions older+1 .. newer: version v is made by
    averaging the fragment pushed on v-1, (v-1) mod `fragments` (strategies.base.Rhythm),
    once each however many versions passed."""
    return sorted({(v - 1) % fragments for v in range(older + 1, min(newer, older + fragments) + 1)})
