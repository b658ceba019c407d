"""The tensor-parallel process group of this process: its rank, its size, and the collectives the
model's layers run (with timeouts).

One group per process, set up once by `init_tp` (the node process is rank 0, each worker one
rank) and torn down by `destroy_tp`; it is process-wide state, like the device, not per-step
state. Before `init_tp` (or after `destroy_tp`) the process is rank 0 of 1: the collectives are
no-ops and nothing touches torch.distributed, so a plain engine never sees any of this.

Backends: gloo on the CPU, NCCL on CUDA (rank r uses `cuda:r`). `timeout_s` bounds every
collective: a rank that died or hangs makes the others' next collective raise
`TPCollectiveError` instead of blocking forever.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


class TPCollectiveError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the group is broken."""


@dataclass(frozen=True)
class _Group:
    rank: int
    size: int
    backend: str
    timeout_s: float


_group: _Group | None = None


def init_tp(rank: int, size: int, init_method: str, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Join the group of `size` ranks as `rank` (`init_method`: "tcp://127.0.0.1:<port>"). Blocks until
    every rank has joined or `timeout_s` passes (then raises TPCollectiveError). Size 1 needs no peers
    and starts no process group."""
    global _group
    if _group is not None:
        raise RuntimeError(f"tensor parallelism is already initialised (rank {_group.rank} of {_group.size})")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of size {size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown tensor-parallel backend {backend!r} (gloo on the CPU, nccl on CUDA)")
    if size > 1:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # torch raises RuntimeError / DistStoreError / DistNetworkError
            raise TPCollectiveError(f"rank {rank} of {size} could not join the group at {init_method} "
                                    f"within {timeout_s:g} s: {_first_line(exc)}") from exc
    _group = _Group(rank, size, backend, timeout_s)


def destroy_tp() -> None:
    """Leave the group (a no-op when none was made). Safe to call on every exit path."""
    global _group
    group, _group = _group, None
    if group is not None and group.size > 1 and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group (a peer died) may fail its teardown; there is nothing to save
            pass


def tp_rank() -> int:
    return 0 if _group is None else _group.rank


def tp_size() -> int:
    return 1 if _group is None else _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (returns it). A no-op at size 1."""
    if tp_size() == 1:
        return x
    try:
        dist.all_reduce(x)
    except Exception as exc:
        raise _collective_error("all_reduce", exc) from exc
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` (same shape on every rank), concatenated along the last dim in rank order.
    Returns `x` itself at size 1."""
    size = tp_size()
    if size == 1:
        return x
    if x.numel() == 0:  # every rank's is empty too (same shape): nothing to exchange
        return x.new_empty(*x.shape[:-1], x.shape[-1] * size)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    try:
        dist.all_gather(parts, x)
    except Exception as exc:
        raise _collective_error("all_gather", exc) from exc
    return torch.cat(parts, dim=-1)


def _collective_error(op: str, exc: BaseException) -> TPCollectiveError:
    group = _group
    where = "" if group is None else f" on rank {group.rank} of {group.size} (timeout {group.timeout_s:g} s)"
    return TPCollectiveError(f"tensor-parallel {op} failed{where}: a peer rank died or hung: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
