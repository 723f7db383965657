"""Data-parallel training over torch.distributed (gloo on CPU), started by ``torchrun``.

We all-reduce gradients ourselves once per optimizer step (one flat buffer) instead of wrapping the model
in ``DistributedDataParallel``: the objectives call ``model.logits`` outside ``forward`` and the head is
tied to the embedding, which DDP's per-parameter hooks handle poorly; one explicit all-reduce after
gradient accumulation is simple, exact and as fast at this size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world() -> World:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); otherwise a world of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_initialized():
        # torch._dynamo (imported lazily, e.g. by the first AdamW) keeps references to a process group that
        # exists when it is imported, so destroy_process_group() would not free it; its gloo worker threads
        # then outlive the interpreter and can abort the process at exit ("terminate called without an
        # active exception": a late Work destructor needs the GIL during finalization). Import it first.
        import torch._dynamo  # noqa: F401

        dist.init_process_group("gloo")
    return World(dist.get_rank(), dist.get_world_size())


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_parameters(model: nn.Module, world: World) -> None:
    if world.distributed:
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


def average_gradients(model: nn.Module, world: World) -> None:
    if not world.distributed:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world.size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def all_sum(values: list[float], world: World) -> list[float]:
    if not world.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def any_flag(flag: bool, world: World) -> bool:
    """True on every rank when any rank raised the flag (so all ranks stop at the same step)."""
    if not world.distributed:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather(obj: Any, world: World) -> list[Any]:
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
