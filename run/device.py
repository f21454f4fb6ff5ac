"""Which device a worker computes on: `--device auto|cpu|cuda|cuda:N`, resolved here.

`auto` is GPU LOCAL_RANK (torchrun's, Slurm's or Open MPI's local rank, see run.cluster)
where CUDA is present, else the CPU; `cuda` is the same GPU, but insists on one. A GPU
that does not exist is an error naming what there is, not a crash in the first step.
"""

from __future__ import annotations

import torch


def resolve(name: str, local_rank: int, *, cuda_devices: int | None = None) -> str:
    """`name` as a WorkerConfig device: "cpu" or "cuda:N". `cuda_devices` defaults to what
    torch sees (tests pass it)."""
    if name == "cpu":
        return "cpu"  # (CUDA untouched: run.children forks only a process that left it so)
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if name == "auto" and count == 0:
        return "cpu"
    if name in ("auto", "cuda"):
        index = local_rank
    elif name.startswith("cuda:") and name[5:].isdigit():
        index = int(name[5:])
    else:
        raise ValueError(f"--device {name}: choose auto, cpu, cuda or cuda:N")
    if count == 0:
        raise ValueError(f"--device {name}: this machine has no CUDA device that torch "
                         f"{torch.__version__} can use: use --device cpu (or auto)")
    if index >= count:
        why = f"local rank {local_rank}" if name in ("auto", "cuda") else name
        raise ValueError(f"--device {name}: {why} asks for GPU {index}, and this machine has "
                         f"{count} (0..{count - 1}): start at most {count} workers here, or "
                         "name the GPU with --device cuda:N")
    return f"cuda:{index}"
