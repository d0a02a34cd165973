"""``decoder_layers_ref``: the readable spec of ``decoder_layers``, with its exact signature; and the layer loop
itself (``decoder_layer_loop``), which the device path and the sharded model run too, with their own matmul, attention
and elementwise ops (``spec_kernels.fused_elementwise``).

Clarity beats speed here: tests and benchmarks compare against it, and ``backend="torch"`` runs it (the CPU
fallback of last resort).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec_kernels.fused_elementwise.ref import REFERENCE_OPS, ElementwiseOps
from spec_kernels.linear.ref import linear_ref
from spec_kernels.tree_attention.ref import tree_attention_ref

# The tensors of one layer in ``decoder_layers``' flat ``weights`` list, in order (None where a model has none).
# "v": the v rows held apart from q/k's (a GGUF file's v in another format), "qkv" then holding q's and k's alone.
# "attn_out_norm", "mlp_out_norm": Gemma's norms of the attention's and the MLP's outputs before the residual add
# (its "post_norm" is the MLP's input norm, as in Llama).
LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down", "q_norm", "k_norm", "v",
                "attn_out_norm", "mlp_out_norm")  # fmt: skip


@dataclass(frozen=True)
class LayerVariant:
    """What a family changes in the Llama layer beside its weights (Gemma 2 and 3; the defaults are Llama's).

    ``windows``: per layer, a sliding window of that many positions (0: the whole sequence), its RoPE then the call's
    ``rope_local`` where one is given; ``softmax_scale``: None for ``D ** -0.5``; ``softcap``: attention scores
    ``c * tanh(s / c)``; ``activation``: the MLP's ``"silu"`` or ``"gelu_tanh"``; ``float32_norms``: each norm's
    product with its (float32) weight in float32, rounded once (``gemma_add_rms_norm``), not Llama's normed row
    rounded before it (the C++ op tells this by the weights' dtype: a model passes float32 norms exactly when it sets
    this)."""

    windows: tuple[int, ...] | None = None
    softmax_scale: float | None = None
    softcap: float | None = None
    activation: str = "silu"
    float32_norms: bool = False

    def __post_init__(self):
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"LayerVariant: activation must be 'silu' or 'gelu_tanh', got {self.activation!r}")
        if self.windows is not None and any(w < 0 for w in self.windows):
            raise ValueError(f"LayerVariant: windows must be >= 0 (0: none), got {self.windows}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"LayerVariant: softcap must be > 0 (None: none), got {self.softcap}")
        if self.softmax_scale is not None and not self.softmax_scale > 0:
            raise ValueError(f"LayerVariant: softmax_scale must be > 0 (None: D ** -0.5), got {self.softmax_scale}")

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s window, None for none."""
        return self.windows[layer] or None if self.windows is not None else None


LLAMA = LayerVariant()


def gemma_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``add_rms_norm_ref``'s contract with Gemma's norm: the normed row times the weight in float32 (Gemma's weights
    hold ``1 + w`` in float32), rounded once to x's dtype."""
    h = x if residual is None else x + residual
    acc = torch.promote_types(h.dtype, torch.float32)  # (float64 stays float64: the exact reference)
    return (F.rms_norm(h.to(acc), (h.shape[-1],), eps=eps) * weight.to(acc)).to(h.dtype), h


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of ``gate_up [..., 2 I]`` (gate columns first): ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


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
    capture=None, ops: ElementwiseOps = REFERENCE_OPS, variant: LayerVariant = LLAMA, rope_local=None,
):  # fmt: skip
    """The body of ``decoder_layers`` in torch ops, with the matmul (``linear(x, w, b)``), the attention
    (``attend(q, k_cache, v_cache, window)``) and the elementwise work (``ops``) given: the reference passes its
    references, the device path its kernels. Each block's output joins the residual stream in the norm that follows it
    (``ops.add_rms_norm``): the same sums, in the same dtype, as adding it first; where the layer has one, the output's
    own norm first (Gemma)."""
    B, T, _ = hidden.shape
    Hkv, D = kv_cache.shape[-2:]
    sizes = (num_heads * D, Hkv * D, Hkv * D)
    activation = ops.silu_mul if variant.activation == "silu" else gelu_tanh_mul_ref
    add_norm = gemma_add_rms_norm if variant.float32_norms else ops.add_rms_norm
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
        x, h = add_norm(delta, h, w["input_norm"], eps)  # [B, T, H] each
        if capture is not None and i in capture:
            streams[i] = h
        q, k, v = qkv_projection(x, w, linear).split(sizes, dim=-1)
        q, k, v = q.reshape(B, T, num_heads, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        if w["q_norm"] is not None:
            q, k = add_norm(q, None, w["q_norm"], eps)[0], add_norm(k, None, w["k_norm"], eps)[0]
        window = variant.window(i)
        cos, sin = rope_local if window is not None and rope_local is not None else rope  # [B, T, D] each
        q, k = ops.rope_qk(q, k, cos, sin)
        kv_cache[i, 0, blocks, offsets] = k  # [B, T, Hkv, D] at positions L_b + t
        kv_cache[i, 1, blocks, offsets] = v
        out = attend(q, kv_cache[i, 0], kv_cache[i, 1], window)  # [B, T, Hq, D]
        delta = linear(out.flatten(2), w["o"], None)  # [B, T, H] (flatten: B may be 0)
        if w["attn_out_norm"] is not None:
            delta = add_norm(delta, None, w["attn_out_norm"], eps)[0]
        x, h = add_norm(delta, h, w["post_norm"], eps)
        delta = linear(activation(linear(x, w["gate_up"], None)), w["down"], None)  # [B, T, H]
        if w["mlp_out_norm"] is not None:
            delta = add_norm(delta, None, w["mlp_out_norm"], eps)[0]
    out, h = add_norm(delta, h, final_norm, eps)
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
    variant: LayerVariant = LLAMA,
    rope_local: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A stack of Llama-family decoder layers over T new tokens per sequence, writing their K/V into ``kv_cache``
    and attending with ``tree_attention_ref``. ``backend`` is ignored. See ``spec_kernels.decoder_layers``."""

    def attend(q, k_cache, v_cache, window):
        scale, cap = variant.softmax_scale, variant.softcap
        return tree_attention_ref(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table,
                                  softmax_scale=scale, softcap=cap, window=window)  # fmt: skip

    return decoder_layer_loop(
        hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table, num_heads, eps,
        linear_ref, attend, capture, variant=variant, rope_local=rope_local,
    )  # fmt: skip
