"""Shared test set-up: one thread per process, so multi-rank tests do not oversubscribe 2 cores."""

import torch

torch.set_num_threads(1)
