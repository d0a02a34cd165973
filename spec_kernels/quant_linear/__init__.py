"""``quant_linear``: ``linear`` on GGUF-quantized weights as the file stores them: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and
the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (so every tensor of llama.cpp's _S/_M/_L mixes but its float ones).

Glossary: a *block* is a run of consecutive weights of one row of ``W [N, K]`` with its scales: 32 weights for the
first five (a float16 scale ``d``, for the _1 types a float16 minimum ``m``, then the quants: Q4_0 nibbles,
``w = d * (q - 8)``, 18 bytes), 256 for a K-quant *super-block* (float16 ``d`` (and ``dmin``) times small integer
scales per 16 or 32 weights; Q4_K 144 bytes, ``w = d sc q - dmin mn``). ``spec_kernels.types.QUANT_FORMATS`` holds
each type's sizes and csrc/quant_blocks_cpu.h draws the layouts. A quantized matrix is ``uint8 [N, K / block_weights *
block_bytes]``, the file's bytes unchanged; *qtype* names its format ("Q4_K" or ggml's type id).

The native backend (``csrc/quant_linear_cpu.cpp``) dequantizes each 32-weight sub-block in registers and multiplies in
float32 with ``linear``'s own tiles and summation order, so ``quant_linear(x, W)`` is bitwise ``linear(x,
dequantize(W))`` in float32 (a bfloat16 x is widened, each output rounded once): batch-invariant like ``linear``, and a
float32 model on its quantized weights gives the logits of the same model dequantized at load. Decoding reads 0.33
(Q2_K: 84 bytes per 256 weights) to 1.06 (Q8_0) bytes per weight where bfloat16 reads 2 (Q4_K 0.56, Q6_K 0.82).

``activations="int8"`` is the second numeric mode, llama.cpp's: x quantized per row and 32-weight block to int8 with
a float scale, integer dot products (AVX2 maddubs, AVX512-VNNI vpdpbusd; csrc/quant_int8_cpu.h), a float32 epilogue
per block. Its spec is ``quant_linear_ref(..., activations="int8")``; every path gives those bits, and a row's result
depends on that row alone (batch-invariant), but not the float mode's values.
"""

from __future__ import annotations

import torch

from spec_kernels._backend import on_device_path, resolve_backend, triton_available
from spec_kernels.quant_linear.ref import quant_linear_ref
from spec_kernels.types import (
    QUANT_FORMATS,
    QuantizedWeight,
    check_activations,
    dequantize_ref,
    quant_row_bytes,
    quant_type_name,
)

__all__ = ["QuantizedWeight", "int8_path", "quant_linear", "quant_linear_ref", "quant_type_name"]

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


def int8_path() -> str:
    """How this process multiplies int8 blocks (``activations="int8"``; chosen once, under ``SPECDEC_CPU_ISA``'s cap):
    ``"amx"`` (AMX-INT8 tiles past 8 x rows, AVX512-VNNI below), ``"vnni"`` (AVX512-VNNI),
    ``"avx2"`` or ``"scalar"``. Builds the extension on first use."""
    from spec_kernels._ext import load_ext

    load_ext()
    return torch.ops.spec_kernels.quant_int8_path()


def quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: str | int,
    *,
    bias: torch.Tensor | None = None,
    activations: str = "float",
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` with the weight read as stored GGUF blocks.

    Parameters
    ----------
    x : Tensor
        ``[..., K]``, K a multiple of the format's block (32, or 256 for a K-quant); float32 or bfloat16 for the
        native kernel.
    weight : Tensor
        uint8 ``[N, K / block_weights * block_bytes]``: the file's blocks, row by row, contiguous.
    qtype : str or int
        A key of ``QUANT_FORMATS`` ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
        or ggml's type id (``gguf.GGMLQuantizationType``).
    bias : Tensor, optional
        ``[N]`` in x's dtype.
    activations : {"float", "int8"}
        The numeric mode: float32 products with the dequantized weights, or x in int8 blocks and integer dot
        products (``quant_linear_ref`` defines both).
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
        An unknown ``activations``, an unsupported qtype, K not a multiple of its block, a weight whose width is not
        K's blocks, a bias of the wrong shape; with backend="native", a non-CPU tensor or a dtype other than float32
        / bfloat16.

    Shapes
    ------
    - x: ``[..., K]`` (M = prod of the leading dims)
    - weight: ``[N, K / block_weights * block_bytes]`` uint8
    - bias: ``[N]``
    - out: ``[..., N]``
    """
    check_activations(activations)
    name = quant_type_name(qtype)
    _check(x, weight, name, bias)
    if backend == "triton":
        raise ValueError("quant_linear: there is no Triton backend (a C++ CPU kernel); use None, 'native' or 'torch'")
    native_fits = x.is_cpu and weight.is_cpu and x.dtype in NATIVE_DTYPES and weight.is_contiguous()
    if backend is None and on_device_path(x.device) and triton_available() and activations == "float":
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
        return quant_linear_ref(x, weight, name, bias=bias, activations=activations)
    if not (x.is_cpu and weight.is_cpu and (bias is None or bias.is_cpu)):
        raise ValueError(f"quant_linear: backend='native' is a CPU kernel but x is on {x.device}; use 'torch'")
    if x.dtype not in NATIVE_DTYPES:
        raise TypeError(f"quant_linear: backend='native' takes float32 or bfloat16 x, got {x.dtype}")
    from spec_kernels._ext import load_ext

    load_ext()
    blocks = weight.view(torch.int8) if activations == "int8" else weight.view(torch.uint8)  # the dtype is the mode
    return torch.ops.spec_kernels.quant_linear(x, blocks, QUANT_FORMATS[name].type_id, bias)
