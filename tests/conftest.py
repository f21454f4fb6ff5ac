"""Shared test set-up: one torch thread per process (the CI machine has 2 cores)."""

import torch

torch.set_num_threads(1)
