"""Process-group glue shared by the stages: rank/world from the launcher's environment (``deepspeed`` or
``torchrun`` set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), gloo on CPU, nccl on GPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_world() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    return rank, world


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def sum_across(value: float, device) -> float:
    """``value`` summed over the processes (``value`` itself in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t)
    return float(t.item())


def local_device(device: str = "auto") -> torch.device:
    if device not in ("auto", None):
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"model.device={device}, but CUDA is not available on this machine (use auto or cpu)")
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
