"""``decoder_layers_ref``: the readable spec of ``decoder_layers``, with its exact signature; and the layer loop
itself (``decoder_layer_loop``), which the device path and the sharded model run too, with their own matmul, attention
and elementwise ops (``spec_kernels.fused_elementwise``).

Clarity beats speed here: tests and benchmarks compare against it, and ``backend="torch"`` runs it (the CPU
fallback of last resort).
"""

from __future__ import annotations

import torch

from spec_kernels.fused_elementwise.ref import REFERENCE_OPS, ElementwiseOps
from spec_kernels.linear.ref import linear_ref
from spec_kernels.tree_attention.ref import tree_attention_ref

# The tensors of one layer in ``decoder_layers``' flat ``weights`` list, in order (None where a model has none).
# "v": the v rows held apart from q/k's (a GGUF file's v in another format), "qkv" then holding q's and k's alone.
LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down", "q_norm", "k_norm", "v")


def qkv_projection(x: torch.Tensor, w: dict, linear) -> torch.Tensor:
    """x's q/k/v projection ``[..., (Hq + 2 Hkv) D]`` from one layer's fields ``w``: ``w["qkv"]`` alone, or where
    the v rows are held apart (``w["v"]``), q/k's output and then v's, each with its rows of the bias."""
    bias = w["qkv_bias"]
    if w["v"] is None:
        return linear(x, w["qkv"], bias)
    n = w["qkv"].shape[0]  # (Hq + Hkv) D
    qk = linear(x, w["qkv"], None if bias is None else bias[:n])
    return torch.cat([qk, linear(x, w["v"], None if bias is None else bias[n:])], dim=-1)


def decoder_layer_loop(
    hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table, num_heads, eps, linear, attend,
    capture=None, ops: ElementwiseOps = REFERENCE_OPS,
):  # fmt: skip
    """The body of ``decoder_layers`` in torch ops, with the matmul (``linear(x, w, b)``), the attention
    (``attend(q, k_cache, v_cache)``) and the elementwise work (``ops``) given: the reference passes its references,
    the device path its kernels. Each block's output joins the residual stream in the norm that follows it
    (``ops.add_rms_norm``): the same sums, in the same dtype, as adding it first."""
    B, T, _ = hidden.shape
    Hkv, D = kv_cache.shape[-2:]
    sizes = (num_heads * D, Hkv * D, Hkv * D)
    cos, sin = rope  # [B, T, D] each
    pos = cache_seqlens.long()[:, None] + torch.arange(T, device=hidden.device)  # [B, T]
    block_size = kv_cache.shape[3]
    if block_table is None:
        blocks = torch.arange(B, device=hidden.device)[:, None].expand(B, T)
    else:
        blocks = block_table.long().gather(1, pos // block_size)  # [B, T]
    offsets = pos % block_size  # [B, T]
    h, delta = None, hidden  # the residual stream, and the block output not yet added to it
    streams = {}  # the residual stream entering each captured layer
    for i in range(len(weights) // len(LAYER_FIELDS)):
        w = dict(zip(LAYER_FIELDS, weights[i * len(LAYER_FIELDS) : (i + 1) * len(LAYER_FIELDS)]))
        x, h = ops.add_rms_norm(delta, h, w["input_norm"], eps)  # [B, T, H] each
        if capture is not None and i in capture:
            streams[i] = h
        q, k, v = qkv_projection(x, w, linear).split(sizes, dim=-1)
        q, k, v = q.reshape(B, T, num_heads, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        if w["q_norm"] is not None:
            q, k = ops.add_rms_norm(q, None, w["q_norm"], eps)[0], ops.add_rms_norm(k, None, w["k_norm"], eps)[0]
        q, k = ops.rope_qk(q, k, cos, sin)
        kv_cache[i, 0, blocks, offsets] = k  # [B, T, Hkv, D] at positions L_b + t
        kv_cache[i, 1, blocks, offsets] = v
        out = attend(q, kv_cache[i, 0], kv_cache[i, 1])  # [B, T, Hq, D]
        x, h = ops.add_rms_norm(linear(out.flatten(2), w["o"], None), h, w["post_norm"], eps)  # (flatten: B may be 0)
        delta = linear(ops.silu_mul(linear(x, w["gate_up"], None)), w["down"], None)  # [B, T, H]
    out, h = ops.add_rms_norm(delta, h, final_norm, eps)
    if capture is None:
        return out
    return out, torch.cat([streams[i] for i in capture], dim=-1) if capture else h.new_empty(B, T, 0)


def decoder_layers_ref(
    hidden: torch.Tensor,
    weights: list[torch.Tensor | None],
    final_norm: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    rope: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
    block_table: torch.Tensor | None = None,
    capture: list[int] | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A stack of Llama-family decoder layers over T new tokens per sequence, writing their K/V into ``kv_cache``
    and attending with ``tree_attention_ref``. ``backend`` is ignored. See ``spec_kernels.decoder_layers``."""

    def attend(q, k_cache, v_cache):
        return tree_attention_ref(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table)

    return decoder_layer_loop(
        hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table, num_heads, eps,
        linear_ref, attend, capture,
    )  # fmt: skip
