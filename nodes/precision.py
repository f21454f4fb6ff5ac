"""Mixed precision on the worker: `--precision bf16-mixed | fp16-mixed`.

The forward and the loss run under `torch.autocast` in the chosen dtype; the weights, the
gradients that are pushed and the coordinator's step stay in the model's own dtype (fp32),
as with PyTorch's automatic mixed precision.

fp16's narrow range makes small gradients underflow, so its loss is scaled up before
backward and the gradients scaled down again before they are pushed or stepped on
(`LossScale`: the dynamic scaling of torch.amp.GradScaler, its defaults). A step whose
gradients overflow is skipped, not pushed, and counted: an overflow says the scale is too
high, not that training diverged, and the scale is halved. fp16 autocast is for CUDA only
here; bf16 has fp32's range and needs no scaling, on the CPU or on CUDA.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Sequence

import torch


class Precision(str, enum.Enum):
    FULL = ""  # the model's own dtype throughout
    BF16 = "bf16-mixed"
    FP16 = "fp16-mixed"

    @classmethod
    def parse(cls, text: str) -> Precision:
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"--precision {text!r}: choose bf16-mixed or fp16-mixed") from None

    def check(self, device: torch.device) -> None:
        """ValueError where this precision cannot run on `device`."""
        if self is Precision.FP16 and device.type != "cuda":
            raise ValueError(f"--precision fp16-mixed needs CUDA, and this worker computes on "
                             f"{device.type}: use bf16-mixed there")

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        """Where the forward and the loss run."""
        if self is Precision.FULL:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self is Precision.BF16 else torch.float16
        return torch.autocast(device_type=device.type, dtype=dtype)


class LossScale:
    """fp16's dynamic loss scale: the loss times `scale` goes into backward; the gradients
    are divided by it again (`unscale`); an overflow halves it and skips the step, and
    `growth_interval` steps in a row without one double it."""

    def __init__(self, scale: float = 2.0**16, *, growth_interval: int = 2000) -> None:
        self.scale = scale
        self.growth_interval = growth_interval
        self.skipped = 0  # steps skipped for an overflow
        self._good = 0  # steps since the last overflow

    def unscale(self, grads: Sequence[torch.Tensor]) -> bool:
        """Divide `grads` by the scale, in place; whether every element is finite. Then
        update the scale (and count the step as skipped where one was not)."""
        finite = True
        with torch.no_grad():
            for g in grads:
                if g.is_floating_point():
                    g.mul_(1.0 / self.scale)
                    finite = finite and bool(torch.isfinite(g).all())
        if finite:
            self._good += 1
            if self._good >= self.growth_interval:
                self.scale *= 2.0
                self._good = 0
        else:
            self.skipped += 1
            self.scale /= 2.0
            self._good = 0
        return finite
