"""Rank 0 of a tensor-parallel group: the engine's target (``TPTarget``, its KV cache shard ``ShardedKVCache``) and
how the group starts (``launch``: worker processes on this host, or ``join_torchrun``) and stops."""

from __future__ import annotations

import datetime
import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from spec_engine.distributed.comm import (
    ALLOC_KV,
    FORWARD,
    LOGITS,
    LOGITS_OF,
    NO_TABLE,
    SHUTDOWN,
    Comm,
    TensorParallelError,
    close_group,
    compaction_parts,
    group_timeout_s,
    handshake,
    pack_bits,
    pack_command,
    send_command,
)
from spec_engine.distributed.worker import joined_key, serve_rank, worker_main
from spec_engine.kv_cache import PagedKVCache
from spec_engine.models.config import ModelConfig
from spec_engine.models.sharded import ShardedLlama, shard_config, shard_plan


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

    def __init__(self, model_dir, cfg: ModelConfig, comm: Comm, processes: list, dtype, device):
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
    # a call packs its inputs on the host and broadcasts them to the workers: no CUDA graph can hold that
    capturable = False

    # the engine's model interface -----------------------------------------------------------------------------

    def fuse(self, max_positions: int | None = None) -> TPTarget:
        return self  # the shards are built fused (one q/k/v and one gate/up matrix per rank)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def forward(self, input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table=None) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``; ``kv_cache`` is rank 0's shard (``ShardedKVCache.data``)."""
        B, T = input_ids.shape
        W = NO_TABLE if block_table is None else block_table.shape[1]
        fields, pending = compaction_parts(self.pending_compaction)
        parts = [input_ids, positions, cache_seqlens] + ([] if block_table is None else [block_table])
        msg = pack_command(FORWARD, {1: B, 2: T, 3: W, **fields}, parts + [pack_bits(tree_mask)] + pending, self.device)

        def run():
            send_command(self.comm, msg)
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
                send_command(self.comm, pack_command(LOGITS, {}, [], self.device))
            else:
                rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
                send_command(self.comm, pack_command(LOGITS_OF, {8: rows.shape[0]}, [], self.device))
                self.comm.broadcast(rows)
            parts = self.comm.gather(self.shard.logits(hidden).reshape(-1, self.plan.vocab_per_rank))
            return torch.cat(parts, dim=-1)[:, : self.config.vocab_size].reshape(*lead, -1)

        return self._guarded(run)

    def kv_cache(self, num_blocks: int, block_size: int) -> ShardedKVCache:
        """Allocate every rank's shard of a paged cache of ``num_blocks`` blocks; returns rank 0's."""
        self._guarded(lambda: send_command(self.comm, pack_command(ALLOC_KV, {8: num_blocks, 9: block_size}, [],
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


def _shutdown(comm: Comm, processes: list) -> None:
    if all(p.is_alive() for p in processes):  # none: torchrun's ranks, told to stop all the same
        try:
            send_command(comm, pack_command(SHUTDOWN, {}, [], comm.device))
            close_group(comm)
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
    timeout = group_timeout_s()
    store = dist.TCPStore(
        "127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(1, world):
        p = ctx.Process(target=worker_main, name=f"specdec-tp{rank}", daemon=True,
                        args=(str(model_dir), rank, world, "127.0.0.1", store.port, str(dtype), dev.type, timeout,
                              os.getpid()))  # fmt: skip
        p.start()
        processes.append(p)
    try:
        _wait_for_workers(store, processes, timeout)
        comm = Comm(store, 0, world, dev, timeout)
        target = TPTarget(model_dir, cfg, comm, processes, dtype, dev)
        handshake(comm, ok=True)
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
    timeout = group_timeout_s()
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout))
    comm = Comm(None, rank, world, dev, timeout, pg=dist.distributed_c10d._get_default_group())
    if rank != 0:
        serve_rank(model_dir, comm, dtype)
        if dist.is_initialized():  # (serve_rank closed it at SHUTDOWN; not after a failure)
            dist.destroy_process_group()
        raise SystemExit(0)
    target = TPTarget(model_dir, ModelConfig.from_dir(model_dir), comm, [], dtype, dev)
    handshake(comm, ok=True)
    return target


def _wait_for_workers(store, processes: list, timeout: float) -> None:
    """Until every worker has reached the store; a worker that exits first (an import error, a script without the
    ``if __name__ == "__main__":`` guard that spawn needs) raises at once instead of after the timeout."""
    import time

    deadline = time.monotonic() + timeout
    for rank, p in enumerate(processes, start=1):
        while not store.check([joined_key(rank)]):
            if not p.is_alive():
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} exited during startup (exit code {p.exitcode}); see its "
                    "stderr. A script that builds LLM(..., tensor_parallel_size > 1) must create it under "
                    "`if __name__ == '__main__':` (workers are spawned processes that import the main module)."
                )
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel worker rank {rank} did not start within {timeout:.0f} s")
            time.sleep(0.02)
