"""``quant_linear``: ``linear`` on GGUF-quantized weights as the file stores them (Q8_0, Q4_0, Q4_1 blocks).

Glossary: a *block* is 32 consecutive weights of one row of ``W [N, K]``, stored as a float16 scale ``d`` (and, for
Q4_1, a float16 minimum ``m``) plus 32 quants: Q8_0 int8 (``w = q * d``, 34 bytes), Q4_0 nibbles (``w = d * (q -
8)``, 18 bytes), Q4_1 nibbles (``w = d * q + m``, 20 bytes). A quantized matrix is ``uint8 [N, K / 32 * block
bytes]``, the file's bytes unchanged; *qtype* names its format ("Q8_0", "Q4_0", "Q4_1" or ggml's type id).

The native backend (``csrc/quant_linear_cpu.cpp``) dequantizes each block in registers and multiplies in float32 with
``linear``'s own tiles and summation order, so ``quant_linear(x, W)`` is bitwise ``linear(x, dequantize(W))`` in
float32 (a bfloat16 x is widened, each output rounded once): batch-invariant like ``linear``, and a float32 model on
its quantized weights gives the logits of the same model dequantized at load. Decoding reads 0.56 (Q4_1: 20 bytes per
32 weights) or 1.06 (Q8_0) bytes per weight where bfloat16 reads 2.
"""

from __future__ import annotations

import torch

from spec_kernels._backend import on_device_path, resolve_backend, triton_available
from spec_kernels.quant_linear.ref import quant_linear_ref
from spec_kernels.types import QUANT_FORMATS, QuantizedWeight, dequantize_ref, quant_row_bytes, quant_type_name

__all__ = ["QuantizedWeight", "quant_linear", "quant_linear_ref", "quant_type_name"]

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _check(x: torch.Tensor, weight: torch.Tensor, qtype: str, bias: torch.Tensor | None) -> None:
    """Shape and dtype errors in Python terms (the C++ op checks the same, for fake tensors too)."""
    if x.dim() < 1:
        raise ValueError("quant_linear: x must be [..., K], got a 0-d tensor")
    k = x.shape[-1]
    try:
        row_bytes = quant_row_bytes(qtype, k)
    except ValueError as e:  # K not a multiple of the type's block, which the message names
        raise ValueError(f"quant_linear: {e}") from None
    if weight.dtype != torch.uint8:
        raise TypeError(f"quant_linear: weight must be uint8 GGUF blocks, got {weight.dtype}")
    f = QUANT_FORMATS[qtype]
    if weight.dim() != 2 or weight.shape[1] != row_bytes:
        raise ValueError(
            f"quant_linear: {qtype} weight must be [N, {row_bytes}] (K / {f.block_weights} blocks of "
            f"{f.block_bytes} bytes) for K = {k}, got shape {tuple(weight.shape)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"quant_linear: bias must be [N] with N = {weight.shape[0]}, got {tuple(bias.shape)}")


def quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: str | int,
    *,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` with the weight read as stored GGUF blocks.

    Parameters
    ----------
    x : Tensor
        ``[..., K]``, K a multiple of 32; float32 or bfloat16 for the native kernel.
    weight : Tensor
        uint8 ``[N, K / 32 * block_bytes]``: the file's blocks, row by row, contiguous.
    qtype : str or int
        "Q8_0", "Q4_0", "Q4_1", or ggml's type id (``gguf.GGMLQuantizationType``).
    bias : Tensor, optional
        ``[N]`` in x's dtype.
    backend : {None, "native", "torch"}
        None: the native kernel on CPU float32 / bfloat16 x; on CUDA (and meta) the blocks dequantized to float32
        and the batch-invariant Triton GEMM (``spec_kernels.linear.triton``); :func:`quant_linear_ref` otherwise.
        "native": the C++ kernel or a clear error. "torch": the reference (dequantize in float32, ``F.linear``, cast
        to x's dtype).

    Returns
    -------
    Tensor
        ``[..., N]`` in x's dtype; float32 sums, the bias added last, one rounding.

    Raises
    ------
    ValueError, TypeError
        An unsupported qtype, K not a multiple of 32, a weight whose width is not K's blocks, a bias of the wrong
        shape; with backend="native", a non-CPU tensor or a dtype other than float32 / bfloat16.

    Shapes
    ------
    - x: ``[..., K]`` (M = prod of the leading dims)
    - weight: ``[N, K / 32 * block_bytes]`` uint8
    - bias: ``[N]``
    - out: ``[..., N]``
    """
    name = quant_type_name(qtype)
    _check(x, weight, name, bias)
    if backend == "triton":
        raise ValueError("quant_linear: there is no Triton backend (a C++ CPU kernel); use None, 'native' or 'torch'")
    native_fits = x.is_cpu and weight.is_cpu and x.dtype in NATIVE_DTYPES and weight.is_contiguous()
    if backend is None and on_device_path(x.device) and triton_available():
        # CUDA: the blocks dequantized to float32 and the batch-invariant Triton GEMM (cuBLAS picks its kernel by M)
        # imported here: spec_kernels.linear imports this package (it routes a QuantizedWeight here), and importing
        # linear.triton runs linear/__init__.py first
        from spec_kernels.linear.triton import linear_triton

        w = dequantize_ref(weight, name)  # [N, K]
        return linear_triton(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
    if backend is None:
        backend = "native" if native_fits else "torch"
    backend = resolve_backend("quant_linear", backend, x.device, has_triton=False)
    if backend == "torch":
        return quant_linear_ref(x, weight, name, bias=bias)
    if not (x.is_cpu and weight.is_cpu and (bias is None or bias.is_cpu)):
        raise ValueError(f"quant_linear: backend='native' is a CPU kernel but x is on {x.device}; use 'torch'")
    if x.dtype not in NATIVE_DTYPES:
        raise TypeError(f"quant_linear: backend='native' takes float32 or bfloat16 x, got {x.dtype}")
    from spec_kernels._ext import load_ext

    load_ext()
    return torch.ops.spec_kernels.quant_linear(x, weight, QUANT_FORMATS[name].type_id, bias)
