"""tree_attention: every node of a token tree attends to the committed prefix plus its own ancestors, in one pass.

Glossary:
- *prefix*: the committed positions ``0 .. L_b-1`` of sequence b; every tree node sees all of them.
- *tree block*: positions ``L_b .. L_b+T-1``, where the tree's own K/V were already written; node i sees node j
  there iff ``tree_mask[b, i, j]``.
- *group*: the ``Hq // Hkv`` query heads that share one KV head (GQA).
- *split*: flash-decoding; the prefix of one (sequence, KV head) is cut into pieces handled by separate programs,
  whose partial outputs are merged by their log-sum-exp.

Three implementations sit behind one public function (dispatch happens once, in ``tree_attention``), one module
per backend:
- ``"native"`` (CPU, ``cpu.py``): one ``F.scaled_dot_product_attention`` call over a boolean mask built once per call
  (float32; 16-bit inputs and soft-capping take matmul, softmax, matmul, 16-bit ones reduced in float64).
- ``"triton"`` (``triton.py``): a flash-attention kernel, registered as ``spec_kernels::tree_attention_triton``.
- ``"torch"``: ``tree_attention_ref`` (spec_kernels/tree_attention/ref.py), the readable spec.
This module holds the public op, its input checks and the dispatch.
"""

from __future__ import annotations

import torch

from spec_kernels._backend import host_value_checks, resolve_backend
from spec_kernels.tree_attention.cpu import TreeAttentionPlan, _native_plan, _native_tree_attention
from spec_kernels.tree_attention.ref import tree_attention_ref
from spec_kernels.tree_attention.triton import DevicePlan, _device_plan, _tree_attention_triton

MAX_HEAD_DIM = 256

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["MAX_HEAD_DIM", "DevicePlan", "TreeAttentionPlan", "plan_tree_attention", "tree_attention"]


# --- input checks -----------------------------------------------------------------------------------------------


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    block_table: torch.Tensor | None,
    check_lengths: bool = True,
) -> None:
    """Raise a clear error for any input that breaks the contract in docs/ARCHITECTURE.md.

    Shapes, dtypes and devices are checked everywhere (metadata: free). The one value check, ``0 <= L_b`` and
    ``L_b + T`` within the cache, reads ``cache_seqlens`` on CPU tensors and is queued with ``torch._assert_async``
    on the device path (CUDA, meta): no host sync, a bad length fails the stream instead (``check_lengths=False``
    skips it where a plan already made it). ``SPECDEC_DEBUG_CHECKS=1`` reads it on the host there too."""
    op = "tree_attention"
    if q.dim() != 4:
        raise ValueError(f"{op}: q must be [B, T, Hq, D], got shape {tuple(q.shape)}")
    B, T, Hq, D = q.shape
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: q must be float32, float16 or bfloat16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(
            f"{op}: q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{op}: k_cache and v_cache must have the same 4-d shape, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"{op}: head dim mismatch: q has D={D}, the cache has D={k_cache.shape[3]}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim D={D} exceeds the supported maximum {MAX_HEAD_DIM}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{op}: Hq={Hq} query heads must be a multiple of Hkv={Hkv} KV heads")
    if tree_mask.dtype != torch.bool:
        raise TypeError(f"{op}: tree_mask must be bool, got {tree_mask.dtype}")
    if tuple(tree_mask.shape) != (B, T, T):
        raise ValueError(f"{op}: tree_mask must be [B, T, T] = {(B, T, T)}, got {tuple(tree_mask.shape)}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64) or tuple(cache_seqlens.shape) != (B,):
        raise TypeError(
            f"{op}: cache_seqlens must be an int32 tensor of shape [B] = ({B},), "
            f"got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens, "tree_mask": tree_mask}
    if block_table is not None:
        tensors["block_table"] = block_table
        if block_table.dtype not in (torch.int32, torch.int64) or block_table.dim() != 2 or block_table.shape[0] != B:
            raise TypeError(
                f"{op}: block_table must be an int32 tensor of shape [B, max_blocks], "
                f"got {block_table.dtype} {tuple(block_table.shape)}"
            )
        capacity = block_table.shape[1] * k_cache.shape[1]
        what = f"block_table too short: max_blocks={block_table.shape[1]} x block_size={k_cache.shape[1]}"
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"{op}: contiguous k_cache must be [B={B}, S, Hkv, D], got {tuple(k_cache.shape)}")
        capacity = k_cache.shape[1]
        what = f"contiguous cache too short: S={capacity}"
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {devices}")
    # L_b + T must fit. On the device path the check is queued on the stream (no host sync, CUDA-graph safe);
    # SPECDEC_DEBUG_CHECKS=1 reads the lengths instead, for the message with the numbers.
    if B == 0 or not check_lengths:
        return
    # a block id outside the cache reads (and the kernels never bound-check it) another row of memory
    num_blocks = k_cache.shape[0]
    ids_ok = f"{op}: block_table holds ids outside [0, num_blocks = {num_blocks})"
    if not host_value_checks(q.device):
        torch._assert_async((cache_seqlens >= 0).all() & (cache_seqlens.max() + T <= capacity), f"{op}: {what}")
        if block_table is not None and block_table.numel():
            torch._assert_async(((block_table >= 0) & (block_table < num_blocks)).all(), ids_ok)
    else:
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0:
            raise ValueError(f"{op}: cache_seqlens must be >= 0, got min {lo}")
        if hi + T > capacity:
            raise ValueError(f"{op}: {what} < max(cache_seqlens) + T = {hi} + {T}")
        if block_table is not None and block_table.numel():
            lo, hi = int(block_table.min()), int(block_table.max())
            if lo < 0 or hi >= num_blocks:
                raise ValueError(f"{ids_ok}: {lo} .. {hi}")


def _check_variant(softcap: float | None, window: int | None) -> None:
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"tree_attention: softcap must be None or a positive number, got {softcap!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"tree_attention: window must be None or a positive int, got {window!r}")


# --- public op --------------------------------------------------------------------------------------------------


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    backend: str | None = None,
    plan: TreeAttentionPlan | DevicePlan | None = None,
) -> torch.Tensor:
    """Attention of T tree nodes over the committed prefix plus their ancestors in the tree.

    Row i of sequence b attends to every cache position ``< L_b`` and to tree position ``L_b + j`` iff
    ``tree_mask[b, i, j]``. The tree's K/V must already be in the cache at ``L_b .. L_b+T-1``. Prefill is the
    special case of a causal (lower-triangular) mask. A row that sees nothing (only possible with ``L_b = 0`` and an
    all-False mask row) outputs zeros.

    Parameters
    ----------
    q : query of the tree nodes (float32, float16 or bfloat16).
    k_cache, v_cache : contiguous ``[B, S, Hkv, D]``, or paged ``[num_blocks, block_size, Hkv, D]`` with
        ``block_table``.
    cache_seqlens : int32 ``L_b``, the committed length of each sequence.
    tree_mask : bool, ``tree_mask[b, i, j]``: node i sees node j.
    block_table : int32, or None for a contiguous cache. Logical position p of sequence b lives in block
        ``block_table[b, p // block_size]`` at offset ``p % block_size``.
    softmax_scale : defaults to ``D ** -0.5``.
    softcap : None, or a positive cap: scaled scores become ``softcap * tanh(score / softcap)`` before the softmax
        (Gemma 2's attention-logit soft-capping).
    window : None, or a positive number of positions (sliding-window attention, HF's ``sliding_window``): a node
        at logical position ``p = L_b + depth`` (depth: the nodes its mask row allows, less one) sees only positions
        ``> p - window``, prefix and ancestors alike (an ancestor at ``L_b`` plus its depth).
    backend : None (Triton on CUDA and meta tensors, native SDPA path on CPU), "torch" (the reference), "triton",
        "native". On CUDA the call never syncs with the host (see ``_check_inputs`` for the one value check); on meta
        tensors it takes the same path and the custom op returns a fake output.
    plan : from ``plan_tree_attention`` with these same ``cache_seqlens``, ``tree_mask`` and ``block_table``, to
        share their preparation (and the length check) among the calls of one forward; the reference ignores it.

    Shapes
    ------
    q ``[B, T, Hq, D]`` with ``Hq % Hkv == 0`` and ``D <= 256``; cache_seqlens ``[B]``; tree_mask ``[B, T, T]``;
    block_table ``[B, max_blocks]``. Returns ``[B, T, Hq, D]`` in q's dtype.
    """
    backend = resolve_backend("tree_attention", backend, q.device)
    kind = {"native": TreeAttentionPlan, "triton": DevicePlan}.get(backend)
    planned = plan is not None and kind is not None  # the plan made the length check: no second one
    _check_inputs(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table, check_lengths=not planned)
    _check_variant(softcap, window)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if backend == "torch":
        return tree_attention_ref(
            q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table, softmax_scale=scale,
            softcap=softcap, window=window,
        )  # fmt: skip
    if backend == "native" and q.device.type != "cpu":
        raise RuntimeError(f"tree_attention: backend='native' is the CPU path; got {q.device.type} tensors")
    group = q.shape[2] // k_cache.shape[2]
    if plan is None:
        plan = _make_plan(backend, k_cache, cache_seqlens, tree_mask, block_table, group)
    elif not isinstance(plan, kind) or getattr(plan, "group", group) != group or (
        plan.batch, plan.num_nodes, plan.cache_shape, plan.paged
    ) != (q.shape[0], q.shape[1], tuple(k_cache.shape), block_table is not None):  # fmt: skip
        raise ValueError(
            "tree_attention: the plan was made for another path or other shapes (batch, T, heads, cache, paging); "
            f"this call takes the {backend} path"
        )
    if backend == "native":
        return _native_tree_attention(q, k_cache, v_cache, plan, scale, softcap, window)
    return _tree_attention_triton(
        q, k_cache, v_cache, plan.cache_seqlens, plan.tree_keys, plan.tree_lens, plan.tile_shared, plan.tile_lens,
        plan.block_table, scale, 0, softcap or 0.0, window or 0,
    )  # fmt: skip


def _make_plan(backend, k_cache, cache_seqlens, tree_mask, block_table, group) -> TreeAttentionPlan | DevicePlan:
    """The plan of the native (CPU) or Triton path, for inputs already checked."""
    if backend == "native":
        return _native_plan(k_cache, cache_seqlens, tree_mask, block_table, group)
    return _device_plan(k_cache, cache_seqlens, tree_mask, block_table, group)


def plan_tree_attention(
    k_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    num_q_heads: int,
    block_table: torch.Tensor | None = None,
    backend: str | None = None,
) -> TreeAttentionPlan | DevicePlan | None:
    """Prepare what every ``tree_attention`` call of one forward shares (same lengths, mask, block table and cache
    layout; q and the cache contents may differ per call), the length check included. Returns None for the
    reference path, which needs no plan.

    Shapes: k_cache as ``tree_attention`` (any layer's: they share one layout); cache_seqlens ``[B]``; tree_mask
    ``[B, T, T]``; block_table ``[B, max_blocks]``.
    """
    if tree_mask.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"plan_tree_attention: tree_mask must be [B, T, T] and k_cache 4-d, got {tuple(tree_mask.shape)} and "
            f"{tuple(k_cache.shape)}"
        )
    B, T = tree_mask.shape[:2]
    q_shape = k_cache.new_empty(()).expand(B, T, num_q_heads, k_cache.shape[-1])  # no memory: shape checks only
    _check_inputs(q_shape, k_cache, k_cache, cache_seqlens, tree_mask, block_table)
    backend = resolve_backend("tree_attention", backend, k_cache.device)
    if backend == "torch" or (backend == "native" and k_cache.device.type != "cpu"):
        return None
    return _make_plan(backend, k_cache, cache_seqlens, tree_mask, block_table, num_q_heads // k_cache.shape[2])
