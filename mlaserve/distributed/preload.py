"""Imported once by the forkserver that forks the tensor-parallel workers, so each worker starts
warm: torch, the worker's modules, and torch's one-time setup of the meta-device kernels that
build_model allocates with (seconds on a busy machine) are paid once, not per worker."""

import torch

import mlaserve.distributed.heartbeat  # noqa: F401
import mlaserve.distributed.worker  # noqa: F401
import mlaserve.executor.model_runner  # noqa: F401
import mlaserve.loading.model_loader  # noqa: F401

with torch.device("meta"):
    torch.nn.Linear(2, 2)
    torch.nn.Embedding(2, 2)
