"""A model's forward captured per bucket and replayed (CUDA graphs, as vLLM's and SGLang's graph runners): the
target's pass of the regular step, and a drafter's forwards while it drafts (a draft model's, an EAGLE head's).

Glossary:
- *bucket* ``(rows, width)``: a captured shape. ``rows`` is a batch size from ``BATCH_BUCKETS`` (a step of B rows
  takes the smallest bucket with ``rows >= B``); ``width`` is the verify width T itself (a plain step's 1, a chain's
  depth + 1, a tree's nodes), so a step's rows are never padded along T.
- *static inputs*: per bucket, persistent tensors the captured forward reads (token ids, positions, cache lengths,
  tree mask, block table, and extras such as an EAGLE head's parent outputs); a step copies its inputs into their
  first B rows before a replay.
- *padding rows*: rows B .. rows - 1 of a bucket. Their cache length is 0 and their block-table row is all
  ``SCRATCH_BLOCK``, so their K/V land in the scratch block, which no request owns and nothing reads.
- *start-up buckets*: the target's buckets captured once when the engine is built (``capture_startup``), before
  the first request, so that no step's time includes a capture (the adaptive controller prices depths by step
  times): batch 1 at each verify width the engine can choose, then the larger batch buckets up to ``max_num_seqs``,
  at most ``MAX_STARTUP_GRAPHS``. Other shapes are captured when first met.
- *outputs*: what the forward returns (the target's logits ``[B, T, V]`` float32 and the features a drafter reads,
  a drafter's hidden states), one buffer each shared by every bucket (the captured forward ends by copying into their
  first rows * width rows): memory is the largest bucket's, not the sum.

Why: a small model's eager forward on a GPU is launch-bound (hundreds of small kernels per step, each a few
microseconds of host work); one graph replay launches them all at once. The captured function is the eager one
(``StepRunner.target_logits``): the same Python, torch ops and Triton kernels, run once at capture on the static
inputs. The kernels are batch-invariant and read no position past a row's own length, so a row's logits and K/V
are bitwise the eager step's whatever the bucket's padding and the block table's width.

The graph mechanism is a seam (``Graph``): ``CudaGraph`` (``torch.cuda.CUDAGraph`` in one memory pool shared by
every bucket) on CUDA; ``ReplayGraph``, which replays by calling the captured function again on the same static
tensors, lets CPU and ``meta`` tests run this module's bucket choice, padding and copies as a GPU would.
``torch.compile`` gives two more (``MECHANISMS``: inductor's fusion under a capture by hand, or
``mode="reduce-overhead"``), timed beside it by ``bench/gpu_decode.py``; the default is the manual capture of the
eager forward, which CI tests.

Outputs are views of the shared buffers: valid until the next replay (the step reads them before it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from spec_engine.kv_cache import SCRATCH_BLOCK

log = logging.getLogger("spec_engine.cuda_graphs")

# captured batch sizes (vLLM's capture sizes): a step of B rows replays the smallest that holds it
BATCH_BUCKETS = (1, 2, 4, 8, *range(16, 257, 8))
# a bucket's rows * width at most: steps wider than this (prefill-sized) are compute-bound, a graph saves them little
MAX_CAPTURE_TOKENS = 512
MAX_GRAPHS = 64  # buckets captured at most; a step of another shape then runs eagerly
# buckets of the target's pass captured at start-up at most (the rest when first met): bounds the start-up's time (a
# warm-up forward and a capture each) and its graph memory, as vLLM's capture sizes do
MAX_STARTUP_GRAPHS = 12

# forward(tokens [B, T], positions [B, T], cache_seqlens [B], tree_mask [B, T, T], block_table [B, W],
#         *extras [B, T, ...])
#   -> a tuple of [B, T, ...] tensors or None (the target's: logits [B, T, V] float32, features [B, T, F] | None)
Forward = Callable[..., tuple[torch.Tensor | None, ...]]


class Graph(Protocol):
    """One captured bucket: ``capture(fn)`` records ``fn`` on the current static tensors; ``replay()`` runs it."""

    def capture(self, fn: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CudaGraph:
    """``torch.cuda.CUDAGraph``, every bucket's in one memory pool (buckets never run at once, and each one's
    results are copied out to the shared outputs, so their intermediates may share memory)."""

    _pools: dict[torch.device, object] = {}

    def __init__(self, device: torch.device):
        self.device = device
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None]) -> None:
        pool = CudaGraph._pools.setdefault(self.device, torch.cuda.graph_pool_handle())
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class ReplayGraph:
    """The stand-in for CPU and ``meta`` tensors: capture records the function, replay calls it again on the same
    static tensors (a CUDA graph re-runs the same kernels on the same addresses)."""

    def __init__(self, device: torch.device):
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class CompiledCudaGraph(CudaGraph):
    """vLLM's way: ``torch.compile(fn, fullgraph=True)`` (inductor fuses the element-wise work between the custom
    ops: norms, RoPE, SiLU times up, the residual adds), then captured by hand as ``CudaGraph``. Each bucket compiles
    once (static shapes) in its capture."""

    def capture(self, fn: Callable[[], None]) -> None:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        compiled()  # compile on the static tensors (padding rows: only the scratch block is written)
        torch.cuda.synchronize(self.device)
        super().capture(compiled)


class ReduceOverhead:
    """``torch.compile(fn, mode="reduce-overhead", fullgraph=True)``: inductor's fusion and its own CUDA graphs
    (cudagraph trees; they may decline a function that writes a tensor it was not given, and say so)."""

    def __init__(self, device: torch.device):
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
        for _ in range(3):  # compile, warm up, record: none of it in a timed replay
            self.fn()

    def replay(self) -> None:
        self.fn()


# the mechanisms by name (EngineConfig.graph_mechanism): the default on CUDA is "cuda_graph"; bench/gpu_decode.py
# times the others beside it
MECHANISMS: dict[str, type] = {"cuda_graph": CudaGraph, "compile_graph": CompiledCudaGraph,
                               "reduce_overhead": ReduceOverhead, "replay": ReplayGraph}  # fmt: skip


def batch_bucket(num_rows: int) -> int | None:
    """The smallest captured batch size holding ``num_rows`` rows (None past the largest)."""
    return next((b for b in BATCH_BUCKETS if b >= num_rows), None)


@dataclass
class _Bucket:
    """One bucket's static inputs and graph. Shapes: tokens, positions [rows, T] int64; cache_seqlens [rows] int32;
    tree_mask [rows, T, T] bool; block_table [rows, W] int32; extras [rows, T, ...] (a head's parent features)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    cache_seqlens: torch.Tensor
    tree_mask: torch.Tensor
    block_table: torch.Tensor
    extras: tuple[torch.Tensor, ...] = ()
    graph: Graph | None = None
    # the rows and table columns the last call wrote (the rest is padding: length 0, scratch blocks)
    written: tuple[int, int] = (0, 0)


class CapturedForward:
    """``forward``, replayed from a captured graph where a call's shape fits a bucket, else run eagerly; called as
    ``forward`` is (``Forward``). Buckets are captured at start-up (``capture_startup``) or
    when first met, with a log line each.

    ``forward``: the eager function (the one captured); ``table_width``: the block table's full width W (a bucket's
    table is that wide, so one graph serves every context length); ``max_rows``: the most rows a step has;
    ``max_width``: the widest call; ``graph``: the mechanism (``MECHANISMS``); ``name``: what the log lines call it.
    """

    def __init__(self, forward: Forward, device: torch.device, *, table_width: int, max_rows: int, max_width: int,
                 graph: type = CudaGraph, max_tokens: int = MAX_CAPTURE_TOKENS, max_graphs: int = MAX_GRAPHS,
                 name: str = "forward"):  # fmt: skip
        self.forward, self.device, self.table_width, self.name = forward, torch.device(device), table_width, name
        self.graph_type, self.max_graphs = graph, max_graphs
        self.max_rows = batch_bucket(max_rows) or BATCH_BUCKETS[-1]  # the largest batch bucket a step can meet
        self.max_width, self.max_tokens = max_width, min(max_tokens, self.max_rows * max_width)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.outputs: list[torch.Tensor | None] | None = None  # [max_tokens, ...] each, shared by every bucket
        self.num_replays = 0
        self.disabled = False  # a capture failed: every step runs eagerly from then on

    def bucket(self, num_rows: int, width: int) -> tuple[int, int] | None:
        """The bucket a step of ``num_rows`` rows verifying ``width`` tokens each replays (None: it runs eagerly)."""
        rows = batch_bucket(num_rows)
        if self.disabled or rows is None or width > self.max_width or rows * width > self.max_tokens:
            return None
        if (rows, width) not in self.buckets and len(self.buckets) >= self.max_graphs:
            return None
        return rows, width

    def capture_startup(self, widths: Sequence[int], limit: int | None = None) -> None:
        """Capture now the buckets a step is likeliest to meet (``widths`` likeliest first): batch 1 at each width,
        then each larger batch bucket up to ``max_rows`` at each, skipping what ``bucket`` would not replay; at most
        ``limit`` (default ``MAX_STARTUP_GRAPHS``), with a log line per bucket and one for the whole."""
        limit = MAX_STARTUP_GRAPHS if limit is None else limit
        keys = [(rows, w) for rows in BATCH_BUCKETS if rows <= self.max_rows for w in dict.fromkeys(widths)]
        keys = [key for key in keys if key not in self.buckets and self.bucket(*key) == key][:limit]
        start = time.perf_counter()
        for rows, width in keys:
            if self._capture(rows, width) is None:  # (a failed capture turned graphs off: logged there)
                return
        if keys:
            log.info("captured %d buckets of the %s at start-up in %.2f s", len(keys), self.name,
                     time.perf_counter() - start)  # fmt: skip

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache_seqlens: torch.Tensor,
                 tree_mask: torch.Tensor, block_table: torch.Tensor,
                 *extras: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
        """``forward``'s result for these inputs (tokens [B, T], positions [B, T], cache_seqlens [B], tree_mask
        [B, T, T], block_table [B, W'] with W' <= W, extras [B, T, ...]): where a bucket replays, views [B, T, ...]
        of the shared outputs (valid until the next replay). A call site passes the same kinds of extras every
        time."""
        B, T = tokens.shape
        key = self.bucket(B, T)
        if key is None:
            return self.forward(tokens, positions, cache_seqlens, tree_mask, block_table, *extras)
        bucket = self.buckets.get(key) or self._capture(*key, extras)
        if bucket is None:
            return self.forward(tokens, positions, cache_seqlens, tree_mask, block_table, *extras)
        self._load(bucket, B, tokens, positions, cache_seqlens, tree_mask, block_table, extras)
        bucket.graph.replay()
        self.num_replays += 1
        rows = key[0]
        return tuple(None if out is None else out[: rows * T].view(rows, T, -1)[:B] for out in self.outputs)

    def _load(self, bucket: _Bucket, B, tokens, positions, cache_seqlens, tree_mask, block_table, extras) -> None:
        """The step's inputs into the bucket's first B rows; rows B.. become padding (length 0, scratch blocks)."""
        for static, given in zip(bucket.extras, extras):
            static[:B].copy_(given)
        W = block_table.shape[1]
        rows, width = bucket.written
        if rows > B:  # a larger call's rows are left there: their blocks are real requests'
            bucket.cache_seqlens[B:rows].zero_()
            bucket.block_table[B:rows].fill_(SCRATCH_BLOCK)
        if width > W:  # (a wider table's columns past this one's: blocks of real requests too)
            bucket.block_table[:B, W:width].fill_(SCRATCH_BLOCK)
        bucket.written = (B, W)
        bucket.tokens[:B].copy_(tokens)
        bucket.positions[:B].copy_(positions)
        bucket.tree_mask[:B].copy_(tree_mask)
        bucket.cache_seqlens[:B].copy_(cache_seqlens)
        bucket.block_table[:B, :W].copy_(block_table)

    def _capture(self, rows: int, width: int, extras: tuple[torch.Tensor, ...] = ()) -> _Bucket | None:
        """A bucket's static inputs (all padding; ``extras`` give their kinds: zeros of their dtype and trailing
        shape), one eager warm-up run on them (Triton compiles, allocations), then its capture. A capture that fails
        turns graphs off (logged once); the step then runs eagerly."""
        start = time.perf_counter()
        dev = self.device
        bucket = _Bucket(
            tokens=torch.zeros(rows, width, dtype=torch.int64, device=dev),
            positions=torch.arange(width, device=dev).repeat(rows, 1),
            cache_seqlens=torch.zeros(rows, dtype=torch.int32, device=dev),
            tree_mask=torch.ones(width, width, dtype=torch.bool, device=dev).tril().repeat(rows, 1, 1),
            block_table=torch.full((rows, self.table_width), SCRATCH_BLOCK, dtype=torch.int32, device=dev),
            extras=tuple(e.new_zeros(rows, width, *e.shape[2:]) for e in extras),
        )

        def body() -> None:
            results = self.forward(bucket.tokens, bucket.positions, bucket.cache_seqlens, bucket.tree_mask,
                                   bucket.block_table, *bucket.extras)  # fmt: skip
            for out, result in zip(self.outputs, results):
                if out is not None:
                    out[: rows * width].copy_(result.flatten(0, 1))

        try:
            results = self.forward(bucket.tokens, bucket.positions, bucket.cache_seqlens, bucket.tree_mask,
                                   bucket.block_table, *bucket.extras)  # fmt: skip  # the warm-up: padding only
            if self.outputs is None:
                self.outputs = [None if r is None else r.new_empty(self.max_tokens, r.shape[-1]) for r in results]
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            bucket.graph = self.graph_type(dev)
            bucket.graph.capture(body)
        except Exception as error:  # (e.g. SPECDEC_DEBUG_CHECKS=1 reads device values, which a capture forbids)
            self.disabled = True
            log.warning("capture of the %s for %d rows x width %d failed; it runs eagerly from now on: %s",
                        self.name, rows, width, error)  # fmt: skip
            return None
        self.buckets[(rows, width)] = bucket
        log.info("captured the %s for %d rows x width %d in %.2f s (%d buckets)", self.name, rows, width,
                 time.perf_counter() - start, len(self.buckets))  # fmt: skip
        return bucket


def captured_forward(forward: Forward, device: torch.device, *, table_width: int, max_rows: int, max_width: int,
                     mechanism: str | None = None, name: str = "forward",
                     startup_widths: Sequence[int] = ()) -> CapturedForward | None:  # fmt: skip
    """The captured forward for a model on ``device``: CUDA graphs on CUDA (``mechanism`` picks another of
    ``MECHANISMS``, e.g. "replay" to run the captured path on CPU or meta in tests); None elsewhere (a CPU runs its
    native multi-step calls, which graphs would not help). With ``startup_widths``, its start-up buckets at those
    verify widths are captured before it is returned (``CapturedForward.capture_startup``)."""
    device = torch.device(device)
    if mechanism is None:
        if device.type != "cuda":
            return None
        mechanism = "cuda_graph"
    if mechanism not in MECHANISMS:
        raise ValueError(f"unknown graph mechanism {mechanism!r}; one of {sorted(MECHANISMS)}")
    captured = CapturedForward(forward, device, table_width=table_width, max_rows=max_rows, max_width=max_width,
                               graph=MECHANISMS[mechanism], name=name)  # fmt: skip
    captured.capture_startup(startup_widths)
    return captured
