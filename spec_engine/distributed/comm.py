"""Tensor parallelism's wire, the same on every rank: the group's collectives (``Comm``), the command every call
rank 0 makes on the target is packed into (``pack_command``, read back with ``Reader``) and sent as
(``send_command`` / ``receive_command``), and the group's start (``handshake``) and end (``close_group``).
Glossary: spec_engine/distributed/__init__.py."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

TIMEOUT_ENV = "SPECDEC_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
IDLE_TIMEOUT = datetime.timedelta(days=30)  # a worker waits this long for the next command (an idle server)
LOAD_TIMEOUT = datetime.timedelta(hours=1)  # for every rank to read its shard (a 70B checkpoint from a slow disk)
HEADER_LEN = 16  # int64 fields opening every command
COMMAND_CAPACITY = 4096  # int64 elements every command broadcast carries; a longer one sends the rest in a second one
NO_TABLE = -1  # header value of W when the cache is contiguous (no block table)

# commands
FORWARD, LOGITS, LOGITS_OF, ALLOC_KV, SHUTDOWN = 1, 2, 3, 4, 5
SHUTDOWN_TIMEOUT_S = 10  # the last all-reduce of a shutdown (a rank that died meanwhile must not hold it up long)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung past the timeout, or failed; the group cannot run any more."""


class Comm:
    """The group's collectives on a process group of its own (not the process-wide default group, so an LLM can be
    built, closed and built again, or two run side by side). Every op waits; a failure raises ``TensorParallelError``.
    """

    def __init__(self, store, rank: int, world: int, device: torch.device, timeout_s: float, pg=None):
        self.rank, self.world, self.device = rank, world, device
        timeout = datetime.timedelta(seconds=timeout_s)
        if pg is not None:  # torchrun's default group
            self.pg = pg
        elif device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world, timeout)

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise TensorParallelError(f"tensor-parallel collective failed on rank {self.rank}: {e}") from e

    def all_reduce(self, t: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        if self.world > 1:
            if timeout is None:
                self._wait(self.pg.allreduce([t]))
                return
            opts = dist.AllreduceOptions()
            opts.timeout = timeout
            self._wait(self.pg.allreduce([t], opts))

    def broadcast(self, t: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout is not None:
            opts.timeout = timeout
        self._wait(self.pg.broadcast([t], opts))

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` on rank 0 (None elsewhere)."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(t) for _ in range(self.world)]] if self.rank == 0 else []
        self._wait(self.pg.gather(out, [t.contiguous()], opts))
        return out[0] if self.rank == 0 else None


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [...] -> int64 words holding 8 bits per byte (the tree mask is the only non-integer input)."""
    flat = mask.reshape(-1).to(torch.uint8)
    flat = F.pad(flat, (0, -flat.numel() % 64))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8) << shifts).sum(-1, dtype=torch.uint8).view(torch.int64)


def unpack_bits(words: torch.Tensor, shape) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    bits = (words.view(torch.uint8)[:, None] >> shifts) & 1
    n = 1
    for s in shape:
        n *= s
    return bits.reshape(-1)[:n].bool().reshape(shape)


def pack_command(cmd: int, fields: dict[int, int], parts: list[torch.Tensor], device) -> torch.Tensor:
    """One int64 command: the header (``cmd``, ``fields`` at their indices, the total length at 7), then ``parts``."""
    body = [p.reshape(-1).to(torch.int64) for p in parts]
    header = [0] * HEADER_LEN
    header[0] = cmd
    for i, v in fields.items():
        header[i] = int(v)
    header[7] = HEADER_LEN + sum(b.numel() for b in body)
    return torch.cat([torch.tensor(header, dtype=torch.int64).to(device, non_blocking=True), *body])


class Reader:
    """Takes the parts of a command back in the order they were packed."""

    def __init__(self, msg: torch.Tensor):
        self.msg, self.at = msg, HEADER_LEN

    def take(self, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        out = self.msg[self.at : self.at + n].view(*shape)
        self.at += n
        return out


# Header layout: 0 cmd; 1-3 B, T, W of a forward (W = NO_TABLE without a block table); 4-6 B, T, W of a queued
# compaction (B = 0: none); 7 total length; 8-9 extra arguments (ALLOC_KV: num_blocks, block_size; LOGITS_OF: rows).


def compaction_parts(pending) -> tuple[dict[int, int], list[torch.Tensor]]:
    if pending is None:
        return {}, []
    cache_seqlens, accepted, num_accepted, table = pending
    B, T = accepted.shape
    W = NO_TABLE if table is None else table.shape[1]
    parts = [cache_seqlens, accepted, num_accepted] + ([] if table is None else [table])
    return {4: B, 5: T, 6: W}, parts


def read_compaction(header: list[int], r: Reader):
    B, T, W = header[4:7]
    if B == 0:
        return None
    cache_seqlens, accepted, num_accepted = r.take(B).int(), r.take(B, T), r.take(B)
    table = None if W == NO_TABLE else r.take(B, W).int()
    return cache_seqlens, accepted, num_accepted, table


def send_command(comm: Comm, msg: torch.Tensor) -> None:
    """Rank 0: one broadcast of COMMAND_CAPACITY elements (a second one for the rest of a longer command)."""
    buf = F.pad(msg[:COMMAND_CAPACITY], (0, max(0, COMMAND_CAPACITY - msg.numel())))
    comm.broadcast(buf)
    if msg.numel() > COMMAND_CAPACITY:
        comm.broadcast(msg[COMMAND_CAPACITY:].contiguous())


def receive_command(comm: Comm) -> tuple[list[int], Reader]:
    buf = torch.empty(COMMAND_CAPACITY, dtype=torch.int64, device=comm.device)
    comm.broadcast(buf, timeout=IDLE_TIMEOUT)
    header = buf[:HEADER_LEN].tolist()
    if header[7] > COMMAND_CAPACITY:
        rest = torch.empty(header[7] - COMMAND_CAPACITY, dtype=torch.int64, device=comm.device)
        comm.broadcast(rest)
        buf = torch.cat([buf, rest])
    return header, Reader(buf)


def close_group(comm: Comm) -> None:
    """Every rank, after SHUTDOWN: one last all-reduce (no rank still has a collective in flight), then this rank's
    group is destroyed now. Left to the interpreter's exit, torchrun's default gloo group sometimes lost its peers
    first, and a gloo worker thread aborted the process after all output was written (exit code -6, 3 to 5 runs in
    24 of the torchrun test)."""
    comm.all_reduce(torch.ones(1, device=comm.device), timeout=datetime.timedelta(seconds=SHUTDOWN_TIMEOUT_S))
    pg, comm.pg = comm.pg, None
    if dist.is_initialized() and pg is dist.distributed_c10d._get_default_group():
        dist.destroy_process_group()


def group_timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def handshake(comm: Comm, ok: bool) -> None:
    """Every rank says whether its shard loaded; raise on rank 0 if one did not."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=comm.device)
    comm.all_reduce(flag, timeout=LOAD_TIMEOUT)
    if comm.rank == 0 and int(flag) != comm.world:
        raise TensorParallelError(f"{comm.world - int(flag)} tensor-parallel worker(s) failed to load their shard")
