"""Ranks 1..N-1 of a tensor-parallel group: a worker process (``worker_main``, started by rank 0's ``launch``) or a
torchrun rank, each serving rank 0's commands on its shard of the target (``serve_rank``)."""

from __future__ import annotations

import datetime
import os
import threading
import traceback

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
    handshake,
    read_compaction,
    receive_command,
    unpack_bits,
)
from spec_engine.kv_cache import PagedKVCache
from spec_engine.models.config import ModelConfig
from spec_engine.models.sharded import ShardedLlama, shard_config, shard_plan
from spec_kernels import compact_kv_


def joined_key(rank: int) -> str:
    """The store key a worker sets once it has reached the TCP store (rank 0's ``launch`` waits for every one)."""
    return f"specdec_tp_joined_{rank}"


def _watch_parent(parent_pid: int) -> None:
    """A worker whose parent is gone exits (no orphans, even if the parent was killed without closing)."""
    import time

    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(1.0)


def worker_main(model_dir, rank, world, host, port, dtype_name, device_type, timeout, parent_pid) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the host's cores
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout))
    store.set(joined_key(rank), "1")
    comm = Comm(store, rank, world, device, timeout)
    serve_rank(model_dir, comm, getattr(torch, dtype_name.removeprefix("torch.")))


@torch.inference_mode()
def serve_rank(model_dir, comm: Comm, dtype: torch.dtype) -> None:
    """A worker's loop: load the shard, then run commands until SHUTDOWN (or the group breaks)."""
    cfg = ModelConfig.from_dir(model_dir)
    plan = shard_plan(cfg, comm.world, comm.rank)
    try:
        from spec_kernels._ext import load_ext

        load_ext()  # rank 0 built it before starting the workers; loading it here keeps it out of the first step
        shard = ShardedLlama(model_dir, cfg, plan, comm, dtype, comm.device)
    except Exception:
        traceback.print_exc()
        handshake(comm, ok=False)
        return
    handshake(comm, ok=True)
    kv = hidden = None
    while True:
        header, r = receive_command(comm)
        cmd = header[0]
        if cmd == SHUTDOWN:
            close_group(comm)
            return
        if cmd == ALLOC_KV:
            kv = PagedKVCache(shard_config(cfg, plan), header[8], header[9], dtype, comm.device)
        elif cmd == FORWARD:
            B, T, W = header[1:4]
            ids, positions, cache_seqlens = r.take(B, T), r.take(B, T), r.take(B).int()
            table = None if W == NO_TABLE else r.take(B, W).int()
            mask = unpack_bits(r.take(-(-B * T * T // 64)), (B, T, T))
            pending = read_compaction(header, r)
            if pending is not None:
                seqlens_p, accepted, num_accepted, table_p = pending
                compact_kv_(kv.planes, seqlens_p, accepted, num_accepted, block_table=table_p)
            hidden = shard.forward(ids, positions, kv.data, cache_seqlens, mask, table)
        elif cmd in (LOGITS, LOGITS_OF):
            rows = hidden  # LOGITS: the last forward's, which stay for the next LOGITS (TPTarget.logits)
            if cmd == LOGITS_OF:
                rows = torch.empty(header[8], cfg.hidden_size, dtype=dtype, device=comm.device)
                comm.broadcast(rows)
            comm.gather(shard.logits(rows).reshape(-1, plan.vocab_per_rank))
        else:
            raise TensorParallelError(f"rank {comm.rank}: unknown command {cmd}")
