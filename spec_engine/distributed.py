"""Tensor parallelism: the target model sharded over N ranks on ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Glossary:
    rank r of N     one process holding one shard; rank 0 is the engine's own process (the scheduler, the drafter,
                    verification), ranks 1..N-1 are workers that only ever run their shard of the target.
    column-parallel a matrix split by output rows: q/k/v (by heads) and gate/up (by intermediate columns); each rank
                    computes its own slice of the outputs, no communication.
    row-parallel    a matrix split by input columns: o and down; each rank's product is a partial sum of the full
                    output, made whole by one all-reduce (Megatron-LM: two all-reduces per layer).
    vocab-parallel  the embedding and lm_head split by vocabulary rows: a rank embeds only the ids it owns (zeros for
                    the rest; one all-reduce sums them), and computes only its slice of the logits, which are
                    gathered on rank 0, where ``verify_tree`` runs.
    command         what rank 0 sends before each call the engine makes on the target (forward, logits, KV cache
                    allocation, shutdown): ONE broadcast of one int64 tensor packing that call's inputs (token ids,
                    positions, cache lengths, block table, the tree mask as bits) and the previous step's accepted
                    path, so every rank compacts its KV shard the same way before running the forward.

Design choices (see docs/ENGINE.md, "Tensor parallelism"):
- Verification runs on rank 0 only, with the gathered logits; the other ranks need only the accepted path, which
  reaches them with the next command (``ShardedKVCache.compact_`` queues it): no broadcast of the verify result, no
  extra collective per step, and no requirement that every rank draws the same random numbers.
- The draft model (and n-gram lookup) runs on rank 0 only: replicating it would cost every rank the draft's compute
  and its KV cache for nothing, since the drafted tree has to reach the workers in the command anyway.
- Each rank holds only its shard of the paged KV cache (its KV heads); the engine's own ``PagedKVCache`` is rank 0's.
- Worker processes are started by the engine (``torch.multiprocessing`` spawn, one per extra rank, a TCP store on
  127.0.0.1 and a free port) or, for several hosts, by ``torchrun`` (``join_torchrun``).
- Faults: a dead worker breaks the group's TCP connections, so the next collective raises at once; rank 0 also checks
  the workers' liveness before each command, and a hung worker is bounded by the group timeout
  (``SPECDEC_TP_TIMEOUT_S``, default 120 s). Once broken, the target raises ``TensorParallelError`` on every call
  and ``healthy`` is False (the server's /health turns 503).
"""

from __future__ import annotations

import datetime
import os
import threading
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spec_engine.kv_cache import PagedKVCache
from spec_engine.models.config import ModelConfig
from spec_engine.models.sharded import ShardedLlama, shard_config, shard_plan
from spec_kernels import compact_kv_

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


# --- communication ---------------------------------------------------------------------------------------------


class _Comm:
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


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [...] -> int64 words holding 8 bits per byte (the tree mask is the only non-integer input)."""
    flat = mask.reshape(-1).to(torch.uint8)
    flat = F.pad(flat, (0, -flat.numel() % 64))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8) << shifts).sum(-1, dtype=torch.uint8).view(torch.int64)


def _unpack_bits(words: torch.Tensor, shape) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    bits = (words.view(torch.uint8)[:, None] >> shifts) & 1
    n = 1
    for s in shape:
        n *= s
    return bits.reshape(-1)[:n].bool().reshape(shape)


def _pack(cmd: int, fields: dict[int, int], parts: list[torch.Tensor], device) -> torch.Tensor:
    """One int64 command: the header (``cmd``, ``fields`` at their indices, the total length at 7), then ``parts``."""
    body = [p.reshape(-1).to(torch.int64) for p in parts]
    header = [0] * HEADER_LEN
    header[0] = cmd
    for i, v in fields.items():
        header[i] = int(v)
    header[7] = HEADER_LEN + sum(b.numel() for b in body)
    return torch.cat([torch.tensor(header, dtype=torch.int64).to(device, non_blocking=True), *body])


class _Reader:
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


def _compaction_parts(pending) -> tuple[dict[int, int], list[torch.Tensor]]:
    if pending is None:
        return {}, []
    seqlens, accepted, num_accepted, table = pending
    B, T = accepted.shape
    W = NO_TABLE if table is None else table.shape[1]
    parts = [seqlens, accepted, num_accepted] + ([] if table is None else [table])
    return {4: B, 5: T, 6: W}, parts


def _read_compaction(header: list[int], r: _Reader):
    B, T, W = header[4:7]
    if B == 0:
        return None
    seqlens, accepted, num_accepted = r.take(B).int(), r.take(B, T), r.take(B)
    table = None if W == NO_TABLE else r.take(B, W).int()
    return seqlens, accepted, num_accepted, table


def _send_command(comm: _Comm, msg: torch.Tensor) -> None:
    """Rank 0: one broadcast of COMMAND_CAPACITY elements (a second one for the rest of a longer command)."""
    buf = F.pad(msg[:COMMAND_CAPACITY], (0, max(0, COMMAND_CAPACITY - msg.numel())))
    comm.broadcast(buf)
    if msg.numel() > COMMAND_CAPACITY:
        comm.broadcast(msg[COMMAND_CAPACITY:].contiguous())


def _receive_command(comm: _Comm) -> tuple[list[int], _Reader]:
    buf = torch.empty(COMMAND_CAPACITY, dtype=torch.int64, device=comm.device)
    comm.broadcast(buf, timeout=IDLE_TIMEOUT)
    header = buf[:HEADER_LEN].tolist()
    if header[7] > COMMAND_CAPACITY:
        rest = torch.empty(header[7] - COMMAND_CAPACITY, dtype=torch.int64, device=comm.device)
        comm.broadcast(rest)
        buf = torch.cat([buf, rest])
    return header, _Reader(buf)


# --- rank 0: the engine's target ---------------------------------------------------------------------------------


class ShardedKVCache(PagedKVCache):
    """Rank 0's shard of the target's paged KV cache (its KV heads). ``compact_`` moves the accepted path here at
    once and queues it for the other ranks, which apply it with the next command, before that command's forward."""

    def __init__(self, target: TPTarget, cfg: ModelConfig, num_blocks: int, block_size: int, dtype, device):
        super().__init__(cfg, num_blocks, block_size, dtype, device)
        self._target = weakref.ref(target)

    def compact_(self, cache_seqlens, accepted_nodes, num_accepted, *, block_table=None) -> None:
        super().compact_(cache_seqlens, accepted_nodes, num_accepted, block_table=block_table)
        self._target().pending_compaction = (cache_seqlens, accepted_nodes, num_accepted, block_table)


class TPTarget:
    """What the engine sees as its target model when ``tensor_parallel_size > 1``: rank 0's shard plus the workers.

    Each call the engine makes (``forward``, ``logits``) sends one command to every rank, runs rank 0's shard (the
    all-reduces inside keep every rank in step), and returns what ``LlamaForCausalLM`` would: hidden states
    [B, T, H] (the same on every rank) and the full logits [B, T, V] gathered on rank 0.
    """

    def __init__(self, model_dir, cfg: ModelConfig, comm: _Comm, processes: list, dtype, device):
        self.config, self.comm, self.processes = cfg, comm, processes
        self.dtype, self.device = dtype, torch.device(device)
        self.plan = shard_plan(cfg, comm.world, 0)
        self.shard = ShardedLlama(model_dir, cfg, self.plan, comm, dtype, self.device)
        self.pending_compaction = None  # the last step's accepted path, for the other ranks (ShardedKVCache)
        self._last_hidden: torch.Tensor | None = None
        self.error: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, comm, processes)

    # None: the engine's native chains (several plain or speculative steps in one C++ call) need the whole model in
    # this process; under tensor parallelism every step is a regular one
    native = None

    # the engine's model interface -----------------------------------------------------------------------------

    def fuse(self, max_positions: int | None = None) -> TPTarget:
        return self  # the shards are built fused (one q/k/v and one gate/up matrix per rank)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def forward(self, input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table=None) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``; ``kv_cache`` is rank 0's shard (``ShardedKVCache.data``)."""
        B, T = input_ids.shape
        W = NO_TABLE if block_table is None else block_table.shape[1]
        fields, pending = _compaction_parts(self.pending_compaction)
        parts = [input_ids, positions, cache_seqlens] + ([] if block_table is None else [block_table])
        msg = _pack(FORWARD, {1: B, 2: T, 3: W, **fields}, parts + [_pack_bits(tree_mask)] + pending, self.device)

        def run():
            _send_command(self.comm, msg)
            self.pending_compaction = None
            return self.shard.forward(input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table)

        self._last_hidden = self._guarded(run)
        return self._last_hidden

    def forward_features(self, *args, layers, **kwargs):
        raise NotImplementedError("EAGLE heads (the target's features) do not run with tensor_parallel_size > 1 yet")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] float32, gathered on rank 0 from every rank's vocabulary slice. The hidden states
        the last forward returned (or a view of all of them) are on every rank already; any other ``hidden`` is
        broadcast first."""
        lead = hidden.shape[:-1]
        last = self._last_hidden
        same = hidden is last or (  # or the same rows viewed another way, e.g. hidden[:, 0] of a one-token pass
            last is not None and hidden.data_ptr() == last.data_ptr() and hidden.numel() == last.numel()
            and hidden.is_contiguous()
        )  # fmt: skip

        def run():
            if same:
                _send_command(self.comm, _pack(LOGITS, {}, [], self.device))
            else:
                rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
                _send_command(self.comm, _pack(LOGITS_OF, {8: rows.shape[0]}, [], self.device))
                self.comm.broadcast(rows)
            parts = self.comm.gather(self.shard.logits(hidden).reshape(-1, self.plan.vocab_per_rank))
            return torch.cat(parts, dim=-1)[:, : self.config.vocab_size].reshape(*lead, -1)

        return self._guarded(run)

    def kv_cache(self, num_blocks: int, block_size: int) -> ShardedKVCache:
        """Allocate every rank's shard of a paged cache of ``num_blocks`` blocks; returns rank 0's."""
        self._guarded(lambda: _send_command(self.comm, _pack(ALLOC_KV, {8: num_blocks, 9: block_size}, [],
                                                             self.device)))  # fmt: skip
        self.pending_compaction = None
        return ShardedKVCache(self, shard_config(self.config, self.plan), num_blocks, block_size, self.dtype,
                              self.device)  # fmt: skip

    # health and lifetime --------------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """No failure so far and every worker alive (a worker that dies while the engine idles shows at once)."""
        return self.error is None and not self._closed and all(p.is_alive() for p in self.processes)

    def _check_workers(self) -> None:
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                raise TensorParallelError(f"tensor-parallel worker rank {rank} died (exit code {p.exitcode})")

    def _guarded(self, run):
        """``run()`` on a live group; any failure breaks the group for good (the ranks may be mid-collective)."""
        if self._closed:
            raise TensorParallelError("the tensor-parallel group was closed")
        if self.error is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier: {self.error}")
        try:
            self._check_workers()
            return run()
        except BaseException as e:
            for p in self.processes:  # a worker that died mid-collective may not be reaped yet: name it if it did
                p.join(timeout=0.5)
            try:
                self._check_workers()
            except TensorParallelError as dead:
                if str(dead) not in str(e):
                    e = TensorParallelError(f"{dead}; {e}") if isinstance(e, TensorParallelError) else dead
            self.error = str(e)
            # a broken group cannot resynchronise: stop the workers without a SHUTDOWN, which a worker still inside
            # this call's collectives would take for its own and wait in until the group timeout (120 s by default)
            self._finalizer.detach()
            _stop(self.processes)
            if isinstance(e, TensorParallelError):
                raise e from None
            raise TensorParallelError(f"tensor-parallel step failed on rank 0: {e!r}") from e

    def close(self) -> None:
        """Stop the workers (idempotent; also done when the target is garbage collected or the process exits)."""
        self._closed = True
        self._finalizer()


def _shutdown(comm: _Comm, processes: list) -> None:
    if all(p.is_alive() for p in processes):  # none: torchrun's ranks, told to stop all the same
        try:
            _send_command(comm, _pack(SHUTDOWN, {}, [], comm.device))
            _close_group(comm)
        except Exception:
            pass
    for p in processes:
        p.join(timeout=5)
    _stop(processes)


def _stop(processes: list) -> None:
    """Terminate the workers still running (torchrun's ranks, none here, time out on their own)."""
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


def _close_group(comm: _Comm) -> None:
    """Every rank, after SHUTDOWN: one last all-reduce (no rank still has a collective in flight), then this rank's
    group is destroyed now. Left to the interpreter's exit, torchrun's default gloo group sometimes lost its peers
    first, and a gloo worker thread aborted the process after all output was written (exit code -6, 3 to 5 runs in
    24 of the torchrun test)."""
    comm.all_reduce(torch.ones(1, device=comm.device), timeout=datetime.timedelta(seconds=SHUTDOWN_TIMEOUT_S))
    pg, comm.pg = comm.pg, None
    if dist.is_initialized() and pg is dist.distributed_c10d._get_default_group():
        dist.destroy_process_group()


def _timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


def launch(model_dir: str | Path, world: int, *, dtype: torch.dtype, device: str = "cpu") -> TPTarget:
    """Rank 0's ``TPTarget``: ``world - 1`` worker processes are started on this host, or, under ``torchrun``
    (its RANK / WORLD_SIZE / MASTER_ADDR environment), this process joins as its rank (``join_torchrun``).

    On CUDA rank r uses device r (NCCL); on CPU every rank uses the CPU (gloo), workers with one thread each.
    Raises ValueError for sizes that do not shard, ``TensorParallelError`` when a worker fails to start."""
    import torch.multiprocessing as mp

    from spec_kernels._ext import load_ext

    asked = torch.device(device)
    if asked.type == "cuda" and asked.index is not None:
        raise ValueError(f"device={device!r}: with tensor parallelism rank r uses cuda:r (under torchrun, its local "
                         "rank); pass device='cuda' (CUDA_VISIBLE_DEVICES picks the GPUs)")  # fmt: skip
    cfg = ModelConfig.from_dir(model_dir)
    for rank in range(world):
        shard_plan(cfg, world, rank)  # every rank's split is valid before any process starts
    load_ext()  # built (once per machine) here, before any worker needs it, not inside a collective's timeout
    if launched_by_torchrun():
        return join_torchrun(model_dir, world, dtype=dtype, device=device)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    if dev.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size={world} needs {world} CUDA devices, {torch.cuda.device_count()} seen")
    timeout = _timeout_s()
    store = dist.TCPStore(
        "127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(1, world):
        p = ctx.Process(target=_worker_main, name=f"specdec-tp{rank}", daemon=True,
                        args=(str(model_dir), rank, world, "127.0.0.1", store.port, str(dtype), dev.type, timeout,
                              os.getpid()))  # fmt: skip
        p.start()
        processes.append(p)
    try:
        _wait_for_workers(store, processes, timeout)
        comm = _Comm(store, 0, world, dev, timeout)
        target = TPTarget(model_dir, cfg, comm, processes, dtype, dev)
        _handshake(comm, ok=True)
    except BaseException:
        for p in processes:
            p.terminate()
            p.join(timeout=5)
        raise
    target._store = store  # the TCP store lives as long as the group
    return target


def join_torchrun(model_dir: str | Path, world: int, *, dtype: torch.dtype, device: str = "cpu") -> TPTarget:
    """Multi-process / multi-node launch: ``torchrun --nnodes .. --nproc-per-node .. script.py`` runs the same script
    on every rank, and each builds ``LLM(..., tensor_parallel_size=WORLD_SIZE)``. Rank 0 gets its target and goes on
    as the engine; on every other rank this call serves commands until rank 0 closes, then exits the process
    (``SystemExit(0)``): the script's code after ``LLM(...)`` runs on rank 0 only."""
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(f"tensor_parallel_size={world} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']}")
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local) if device == "cuda" else torch.device(device)
    timeout = _timeout_s()
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout))
    comm = _Comm(None, rank, world, dev, timeout, pg=dist.distributed_c10d._get_default_group())
    if rank != 0:
        serve_rank(model_dir, comm, dtype)
        if dist.is_initialized():  # (serve_rank closed it at SHUTDOWN; not after a failure)
            dist.destroy_process_group()
        raise SystemExit(0)
    target = TPTarget(model_dir, ModelConfig.from_dir(model_dir), comm, [], dtype, dev)
    _handshake(comm, ok=True)
    return target


def _joined_key(rank: int) -> str:
    return f"specdec_tp_joined_{rank}"


def _wait_for_workers(store, processes: list, timeout: float) -> None:
    """Until every worker has reached the store; a worker that exits first (an import error, a script without the
    ``if __name__ == "__main__":`` guard that spawn needs) raises at once instead of after the timeout."""
    import time

    deadline = time.monotonic() + timeout
    for rank, p in enumerate(processes, start=1):
        while not store.check([_joined_key(rank)]):
            if not p.is_alive():
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} exited during startup (exit code {p.exitcode}); see its "
                    "stderr. A script that builds LLM(..., tensor_parallel_size > 1) must create it under "
                    "`if __name__ == '__main__':` (workers are spawned processes that import the main module)."
                )
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel worker rank {rank} did not start within {timeout:.0f} s")
            time.sleep(0.02)


def _handshake(comm: _Comm, ok: bool) -> None:
    """Every rank says whether its shard loaded; raise on rank 0 if one did not."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=comm.device)
    comm.all_reduce(flag, timeout=LOAD_TIMEOUT)
    if comm.rank == 0 and int(flag) != comm.world:
        raise TensorParallelError(f"{comm.world - int(flag)} tensor-parallel worker(s) failed to load their shard")


# --- ranks 1..N-1 --------------------------------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    """A worker whose parent is gone exits (no orphans, even if the parent was killed without closing)."""
    import time

    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(1.0)


def _worker_main(model_dir, rank, world, host, port, dtype_name, device_type, timeout, parent_pid) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the host's cores
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout))
    store.set(_joined_key(rank), "1")
    comm = _Comm(store, rank, world, device, timeout)
    serve_rank(model_dir, comm, getattr(torch, dtype_name.removeprefix("torch.")))


@torch.inference_mode()
def serve_rank(model_dir, comm: _Comm, dtype: torch.dtype) -> None:
    """A worker's loop: load the shard, then run commands until SHUTDOWN (or the group breaks)."""
    cfg = ModelConfig.from_dir(model_dir)
    plan = shard_plan(cfg, comm.world, comm.rank)
    try:
        from spec_kernels._ext import load_ext

        load_ext()  # rank 0 built it before starting the workers; loading it here keeps it out of the first step
        shard = ShardedLlama(model_dir, cfg, plan, comm, dtype, comm.device)
    except Exception:
        traceback.print_exc()
        _handshake(comm, ok=False)
        return
    _handshake(comm, ok=True)
    kv = hidden = None
    while True:
        header, r = _receive_command(comm)
        cmd = header[0]
        if cmd == SHUTDOWN:
            _close_group(comm)
            return
        if cmd == ALLOC_KV:
            kv = PagedKVCache(shard_config(cfg, plan), header[8], header[9], dtype, comm.device)
        elif cmd == FORWARD:
            B, T, W = header[1:4]
            ids, positions, seqlens = r.take(B, T), r.take(B, T), r.take(B).int()
            table = None if W == NO_TABLE else r.take(B, W).int()
            mask = _unpack_bits(r.take(-(-B * T * T // 64)), (B, T, T))
            pending = _read_compaction(header, r)
            if pending is not None:
                seqlens_p, accepted, num_accepted, table_p = pending
                compact_kv_(kv.planes, seqlens_p, accepted, num_accepted, block_table=table_p)
            hidden = shard.forward(ids, positions, kv.data, seqlens, mask, table)
        elif cmd in (LOGITS, LOGITS_OF):
            rows = hidden  # LOGITS: the last forward's, which stay for the next LOGITS (TPTarget.logits)
            if cmd == LOGITS_OF:
                rows = torch.empty(header[8], cfg.hidden_size, dtype=dtype, device=comm.device)
                comm.broadcast(rows)
            comm.gather(shard.logits(rows).reshape(-1, plan.vocab_per_rank))
        else:
            raise TensorParallelError(f"rank {comm.rank}: unknown command {cmd}")
