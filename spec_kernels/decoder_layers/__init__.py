"""``decoder_layers``: a model's whole stack of Llama-family decoder layers over a KV cache, as one op.

Glossary: B sequences, T new tokens each (tree nodes, a chain, one decode token or a prefill chunk), H the hidden
size, Hq / Hkv query / KV heads of D elements, L_b the committed length of sequence b.

Why one op: at the sizes where a CPU serves (the default target: 8 layers, H = 320) a forward is ~250 small torch
ops, and their dispatch, not the arithmetic, is the cost: about 5x what the matmuls take per decode step.
The native backend (``csrc/decoder_layers_cpu.cpp``) runs every layer in one C++ call: the small-M linear kernel for
the four matmuls of a layer, and plain loops over rows for RMSNorm, RoPE, the KV write, tree attention and SiLU (or
the GELU-tanh of Gemma's ``LayerVariant``).
It is batch-invariant like ``linear``: a tree node's hidden state is bitwise plain decoding's of the same tokens.

On CUDA and meta tensors the same computation runs as torch ops around the fast kernels (``linear``,
``tree_attention``, ``fused_elementwise``'s norms, RoPE and SiLU); ``decoder_layers_ref`` is that loop over the
references.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spec_kernels._backend import resolve_backend
from spec_kernels.decoder_layers.cpu import (
    SPEC_CHAIN_MAX_NODES,
    LayerWeights,
    NativeHead,
    NativeModel,
    _op_tensor,
    draft_chain,
    eagle3_draft,
    native_model,
    plain_steps,
    spec_chain,
    tree_step,
)
from spec_kernels.decoder_layers.ref import LAYER_FIELDS, LLAMA, LayerVariant, decoder_layer_loop, decoder_layers_ref
from spec_kernels.fused_elementwise import layer_ops
from spec_kernels.linear import linear
from spec_kernels.tree_attention import plan_tree_attention, tree_attention

__all__ = [
    "SPEC_CHAIN_MAX_NODES",
    "LayerVariant",
    "LayerWeights",
    "NativeHead",
    "NativeModel",
    "decoder_layers",
    "draft_chain",
    "eagle3_draft",
    "native_model",
    "plain_steps",
    "spec_chain",
    "tree_step",
]


def _native_weights(x: torch.Tensor, weights: Sequence, kv_cache: torch.Tensor) -> list[torch.Tensor] | None:
    """The flat weights where backend=None takes the C++ op (CPU, one float32 or bfloat16 dtype for the activations
    ``x``, the layers and the cache), else None."""
    layers = weights if isinstance(weights, LayerWeights) else LayerWeights(weights)
    fits = x.is_cpu and layers.takes(x.dtype) and x.dtype == kv_cache.dtype
    return layers.flat if fits else None


def decoder_layers(
    hidden: torch.Tensor,
    weights: Sequence[torch.Tensor | None],
    final_norm: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    rope: torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
    block_table: torch.Tensor | None = None,
    capture: Sequence[int] | None = None,
    variant: LayerVariant = LLAMA,
    rope_local: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run T new tokens per sequence through every decoder layer and return the final-normed hidden states.

    Per layer: ``x = rms_norm(h)``; q/k/v from one fused matrix (plus bias), optional per-head q/k RMSNorm (Qwen3),
    rotate-half RoPE; K/V written to the cache at positions ``L_b .. L_b+T-1``; ``tree_attention`` over the prefix
    and the nodes ``tree_mask`` allows; ``h += attn @ Wo^T``; ``h += (silu(x Wg^T) * x Wu^T) @ Wd^T`` on the
    post-attention norm. Finally ``rms_norm(h) * final_norm``.

    Parameters
    ----------
    hidden : the token embeddings, float32 or bfloat16 for the native backend (the residual stream, norms, RoPE and
        softmax run in float32 inside it; matmuls and the cache in the model's dtype).
    weights : ``len(LAYER_FIELDS)`` tensors per layer in the order of ``spec_kernels.decoder_layers.ref.LAYER_FIELDS``:
        input norm ``[H]``, qkv ``[(Hq + 2 Hkv) D, H]``, qkv bias ``[(Hq + 2 Hkv) D]`` or None, o ``[H, Hq D]``,
        post-attention norm ``[H]``, gate_up ``[2 I, H]`` (gate rows first), down ``[H, I]``, q_norm and k_norm
        ``[D]`` or None, v ``[Hkv D, H]`` or None (v's rows apart: qkv is then ``[(Hq + Hkv) D, H]``). The
        matrices may be ``QuantizedWeight`` (GGUF blocks, ``spec_kernels.quant_linear``): the native path multiplies
        them as stored, the torch paths through ``linear``.
    final_norm : ``[H]``.
    kv_cache : ``[layers, 2, B, S, Hkv, D]``, or paged ``[layers, 2, num_blocks, block_size, Hkv, D]`` with
        ``block_table``; written in place.
    cache_seqlens : int32 ``L_b``.
    rope : cos and sin of every new token's position, ``[2, B, T, D]`` (a table row per position).
    tree_mask : bool, ``tree_mask[b, i, j]``: node i sees node j (causal for prefill).
    num_heads : Hq; eps : the RMSNorm epsilon.
    block_table : int32 ``[B, max_blocks]`` for a paged cache.
    capture : layer indices whose input residual stream to return too (EAGLE-3's low/mid/high features), in the
        order given; None returns the hidden states alone.
    variant : what the family changes in the layer (``LayerVariant``: Gemma's sliding windows, query scale,
        soft-capping, GELU-tanh and float32 norms); its "attn_out_norm" / "mlp_out_norm" fields (Gemma's sandwich
        norms) normalise the attention's and the MLP's outputs before the residual add.
    rope_local : ``[2, B, T, D]``, the RoPE of the layers with a window (Gemma 3's local base); None: ``rope``.
    backend : None (native on CPU float32 / bfloat16, torch ops around the device kernels elsewhere), "native",
        "torch" (the reference). "triton" raises: this op composes the Triton kernels rather than being one.

    Returns
    -------
    Tensor ``[B, T, H]`` in hidden's dtype; with ``capture``, (that, the captured streams ``[B, T, len(capture) * H]``
    concatenated in ``capture``'s order).

    Raises
    ------
    ValueError, TypeError
        Bad shapes or dtypes, a position past a sequence's cache, a block id outside the cache (native backend).
    """
    flat = _native_weights(hidden, weights, kv_cache)  # None: the native path does not take these tensors
    weights = list(weights)
    if len(weights) % len(LAYER_FIELDS) != 0:
        raise ValueError(f"decoder_layers: weights must hold {len(LAYER_FIELDS)} tensors per layer ({LAYER_FIELDS})")
    layers = None if capture is None else [int(i) for i in capture]
    if layers is not None and not all(0 <= i < len(weights) // len(LAYER_FIELDS) for i in layers):
        raise ValueError(f"decoder_layers: capture {layers} names a layer the model does not have")
    num_layers = len(weights) // len(LAYER_FIELDS)
    if variant.windows is not None and len(variant.windows) != num_layers:
        raise ValueError(f"decoder_layers: variant.windows has {len(variant.windows)} entries for {num_layers} layers")
    if rope_local is not None and (rope_local.shape != rope.shape or rope_local.dtype != rope.dtype):
        raise ValueError(f"decoder_layers: rope_local must be like rope ({tuple(rope.shape)} {rope.dtype}), got "
                         f"{tuple(rope_local.shape)} {rope_local.dtype}")  # fmt: skip
    if backend is None and flat is None:
        return _device_layers(hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table,
                              num_heads, eps, layers, variant, rope_local)  # fmt: skip
    backend = resolve_backend("decoder_layers", backend, hidden.device, has_triton=False)
    if backend == "torch":
        return decoder_layers_ref(
            hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, num_heads=num_heads, eps=eps,
            block_table=block_table, capture=layers, variant=variant, rope_local=rope_local,
        )  # fmt: skip
    if not hidden.is_cpu:
        raise RuntimeError(f"decoder_layers: backend='native' is the CPU path; got {hidden.device.type} tensors")
    from spec_kernels._ext import load_ext

    load_ext()
    if flat is None:  # backend="native" asked for tensors it does not take: the C++ op says which
        flat = [_op_tensor(w) for w in weights]
    inputs = [cache_seqlens, rope, tree_mask, block_table, rope_local]  # LayerInputs in csrc/decoder_layers_cpu.cpp
    out, features = torch.ops.spec_kernels.decoder_layers(
        hidden, flat, final_norm, kv_cache, inputs, num_heads, eps, layers or [], list(variant.windows or []),
        variant.softmax_scale or 0.0, variant.softcap or 0.0, variant.activation,
    )  # fmt: skip
    return out if layers is None else (out, features)


def _device_layers(
    hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table, num_heads, eps, capture=None,
    variant=LLAMA, rope_local=None,
):  # fmt: skip
    """The loop of torch ops with the fast kernels (the matmul, the attention, the fused elementwise ops): CUDA, meta,
    and dtypes the C++ op does not take."""
    plan = plan_tree_attention(kv_cache[0, 0], cache_seqlens, tree_mask, num_q_heads=num_heads, block_table=block_table)

    def attend(q, k_cache, v_cache, window):
        scale, cap = variant.softmax_scale, variant.softcap
        return tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, block_table=block_table,
                              softmax_scale=scale, softcap=cap, window=window, plan=plan)  # fmt: skip

    return decoder_layer_loop(
        hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table, num_heads, eps,
        linear, attend, capture, layer_ops(), variant, rope_local,
    )  # fmt: skip
