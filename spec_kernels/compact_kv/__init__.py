"""``compact_kv_``: move the K/V of each accepted path next to the committed prefix, for all layers at once.

Glossary: a *plane* is one layer's K or V cache; N stacks every plane to move (2 x layers), so one call serves a
whole model. L_b (``cache_seqlens[b]``) is sequence b's committed length; the step's tree K/V sit at slots
L_b .. L_b+T-1, and ``accepted_nodes[b, :num_accepted[b]]`` is the accepted path through that tree.

The native backend is the C++/CUDA extension in ``csrc/`` (``torch.ops.spec_kernels.compact_kv_``), built on first
use by :mod:`spec_kernels._ext`. There is no Triton path: this op is a pure row copy.
"""

from __future__ import annotations

import torch

from spec_kernels._backend import debug_checks, on_device_path, resolve_backend
from spec_kernels.compact_kv.ref import compact_kv_ref

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index(t: object, name: str, rank: int, shape: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"compact_kv_: {name} must be a torch.Tensor {shape}, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"compact_kv_: {name} must be int32 or int64, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"compact_kv_: {name} must be {shape}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"compact_kv_: {name} is on {t.device} but cache is on {device}; put all inputs on one device")


def _check_inputs(
    cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    block_table: torch.Tensor | None,
) -> None:
    """Shapes, dtypes and devices: metadata only, so this never syncs."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"compact_kv_: cache must be a torch.Tensor, got {type(cache).__name__}")
    paged = block_table is not None
    if cache.dim() < 3:
        layout = "paged [N, num_blocks, block_size, ...]" if paged else "[N, B, S, ...]"
        raise ValueError(f"compact_kv_: cache must be {layout}, got shape {tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise ValueError(f"compact_kv_: cache must be contiguous (rows move as whole copies), got {cache.stride()=}")
    _check_index(cache_seqlens, "cache_seqlens", 1, "[B]", cache.device)
    _check_index(accepted_nodes, "accepted_nodes", 2, "[B, T]", cache.device)
    _check_index(num_accepted, "num_accepted", 1, "[B]", cache.device)
    batch = cache_seqlens.shape[0]
    for name, t in (("accepted_nodes", accepted_nodes), ("num_accepted", num_accepted)):
        if t.shape[0] != batch:
            raise ValueError(f"compact_kv_: {name} has batch {t.shape[0]} but cache_seqlens has {batch}")
    if paged:
        _check_index(block_table, "block_table", 2, "[B, max_blocks]", cache.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"compact_kv_: block_table has batch {block_table.shape[0]} but cache_seqlens has {batch}")
    elif cache.shape[1] != batch:
        raise ValueError(
            f"compact_kv_: cache [N, B, S, ...] has B = {cache.shape[1]} but cache_seqlens has {batch} "
            "(pass block_table for a paged cache)"
        )


def _check_values(
    cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    block_table: torch.Tensor | None,
) -> None:
    """Index ranges, for the reference path on CPU tensors, and on CUDA with ``SPECDEC_DEBUG_CHECKS=1`` (reading
    values there costs host syncs).

    The native CPU op checks the same ranges in C++ with the same messages, at no cost: these torch-op checks cost
    more than the whole native op at B=1.
    """
    num_nodes = accepted_nodes.shape[1]
    counts = num_accepted.to(torch.int64)  # [B]
    bad = ((counts < 0) | (counts > num_nodes)).nonzero()
    if len(bad):
        b = int(bad[0])
        raise ValueError(f"compact_kv_: num_accepted[{b}] = {int(counts[b])} is outside [0, T = {num_nodes}]")
    base = cache_seqlens.to(torch.int64)  # [B]
    bad = (base < 0).nonzero()
    if len(bad):
        b = int(bad[0])
        raise ValueError(f"compact_kv_: cache_seqlens[{b}] = {int(base[b])} is negative")
    steps = torch.arange(num_nodes, device=counts.device)  # [T]
    keep = steps < counts[:, None]  # [B, T]
    nodes = accepted_nodes.to(torch.int64)  # [B, T]
    bad = ((nodes < 0) & keep).nonzero()
    if len(bad):
        b, t = bad[0].tolist()
        raise ValueError(f"compact_kv_: accepted_nodes[{b}, {t}] = {int(nodes[b, t])} is padding inside num_accepted")
    if block_table is None:
        capacity, what = cache.shape[2], f"S = {cache.shape[2]}"
    else:
        block_size = cache.shape[2]
        capacity = block_table.shape[1] * block_size
        what = f"block_table covers {block_table.shape[1]} blocks x {block_size} = {capacity} slots"
    src = base[:, None] + nodes  # [B, T]
    bad = ((src >= capacity) & keep).nonzero()
    if len(bad):
        b, t = bad[0].tolist()
        raise ValueError(
            f"compact_kv_: sequence {b} reads slot cache_seqlens[{b}] + accepted_nodes[{b}, {t}] = {int(src[b, t])}, "
            f"past the cache ({what})"
        )
    dst = base[:, None] + steps  # [B, T]
    bad = ((dst >= capacity) & keep).nonzero()
    if len(bad):
        b, t = bad[0].tolist()
        raise ValueError(f"compact_kv_: sequence {b} writes slot {int(dst[b, t])}, past the cache ({what})")
    if block_table is not None:
        table = block_table.to(torch.int64)  # [B, max_blocks]
        for name, slots in (("reads", src), ("writes", dst)):
            blocks = table.gather(1, (slots // block_size).clamp(0, block_table.shape[1] - 1))  # [B, T]
            bad = (((blocks < 0) | (blocks >= cache.shape[1])) & keep).nonzero()
            if len(bad):
                b, t = bad[0].tolist()
                raise ValueError(
                    f"compact_kv_: sequence {b} {name} slot {int(slots[b, t])} in block {int(blocks[b, t])}, "
                    f"outside the cache's {cache.shape[1]} blocks"
                )


def compact_kv_(
    cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Move each accepted path's K/V rows to the slots right after the committed prefix, in place.

    For every plane n, sequence b and t < num_accepted[b]::

        cache[n, b, L_b + t] <- old cache[n, b, L_b + accepted_nodes[b, t]]      (L_b = cache_seqlens[b])

    Nothing else changes. Sources and destinations may overlap (path [0, 1, 3, 4]); every implementation reads a
    row before anything overwrites it. Rows already in place (a chain) are not touched. Copies are bitwise, so any
    dtype and any trailing shape work.

    Parameters
    ----------
    cache : Tensor
        Contiguous ``[N, B, S, ...]``, or paged ``[N, num_blocks, block_size, ...]`` with ``block_table``.
        N stacks every plane to move (2 x layers) so one launch serves the whole model.
    cache_seqlens : Tensor
        ``[B]`` int32/int64, L_b: the committed length of each sequence.
    accepted_nodes : Tensor
        ``[B, T]`` int32/int64, the accepted path from the root (from ``verify_tree``), padded with ``PAD_NODE``.
    num_accepted : Tensor
        ``[B]`` int32/int64, the path length including the root (entries past it are ignored).
    block_table : Tensor, optional
        ``[B, max_blocks]`` int32: logical slot p of sequence b lives in block ``block_table[b, p // block_size]``
        at offset ``p % block_size``. Blocks holding slots >= L_b must not be shared between sequences.
    backend : {None, "native", "torch"}
        None or "native": the C++ (CPU) / CUDA extension, compiled on first use. "torch": :func:`compact_kv_ref`.
        "triton" raises: this op has no Triton path.

    Raises
    ------
    TypeError, ValueError
        Bad ranks, batch sizes, dtypes, devices or a non-contiguous cache; on CPU tensors also an index past the
        cache or the block table. CUDA tensors are value-checked only with ``SPECDEC_DEBUG_CHECKS=1`` (the checks
        read indices on the host, a sync): otherwise rows whose slots fall outside the cache are skipped by the
        kernel, with no host sync. Meta tensors (a stand-in for CUDA) take the CUDA path up to the op call and
        then do nothing: the op has no output, and the C++ extension need not be built.

    Shapes
    ------
    - cache: ``[N, B, S, *row]`` or ``[N, num_blocks, block_size, *row]``, e.g. ``row = [Hkv, D]``
    - cache_seqlens, num_accepted: ``[B]``
    - accepted_nodes: ``[B, T]``
    - block_table: ``[B, max_blocks]``
    """
    backend = resolve_backend("compact_kv_", backend, cache.device, has_triton=False)
    _check_inputs(cache, cache_seqlens, accepted_nodes, num_accepted, block_table)
    if backend == "torch":
        if cache.device.type == "cpu":
            _check_values(cache, cache_seqlens, accepted_nodes, num_accepted, block_table)
        compact_kv_ref(cache, cache_seqlens, accepted_nodes, num_accepted, block_table=block_table)
        return
    if on_device_path(cache.device) and debug_checks():
        _check_values(cache, cache_seqlens, accepted_nodes, num_accepted, block_table)  # host syncs: debug only
    if cache.device.type == "meta":
        return  # the CUDA path up to the op call; the C++ op's Meta kernel would only repeat the checks above
    from spec_kernels._ext import load_ext

    load_ext()
    torch.ops.spec_kernels.compact_kv_(cache, cache_seqlens, accepted_nodes, num_accepted, block_table)
