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

Modules: ``comm`` (the group's collectives and the command wire format, shared by every rank), ``target`` (rank 0:
the engine's ``TPTarget`` and the launch), ``worker`` (ranks 1..N-1: the loop that serves commands).
"""

from spec_engine.distributed.comm import TensorParallelError
from spec_engine.distributed.target import ShardedKVCache, TPTarget, join_torchrun, launch, launched_by_torchrun
from spec_engine.distributed.worker import serve_rank

__all__ = [
    "ShardedKVCache",
    "TPTarget",
    "TensorParallelError",
    "join_torchrun",
    "launch",
    "launched_by_torchrun",
    "serve_rank",
]
