"""``linear``: ``F.linear`` for the small-M shapes of decoding (M = 1) and verification (M = T <= 64) on CPU, and a
batch-invariant GEMM on CUDA (``spec_kernels.linear.triton``).

Glossary: M is the number of rows of x (``prod(x.shape[:-1])``), N the output features (rows of ``weight [N, K]``),
K the reduction length.

The native CPU kernel (its speed, its threads) is ``spec_kernels.linear.cpu``; the Triton GEMM is
``spec_kernels.linear.triton``. Both are batch-invariant: each output element is reduced in one fixed order
whatever M is, so ``linear(x)[i]`` is bitwise ``linear(x[i:i+1])[0]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec_kernels._backend import on_device_path, resolve_backend, triton_available
from spec_kernels.linear.cpu import NATIVE_DTYPES, _native_op, native_path
from spec_kernels.linear.ref import linear_ref
from spec_kernels.linear.triton import CONFIGS as TRITON_CONFIGS
from spec_kernels.linear.triton import linear_triton
from spec_kernels.quant_linear import quant_linear
from spec_kernels.types import QuantizedWeight

__all__ = ["linear", "native_path"]

# backend=None takes the native kernel up to this M: every M in both dtypes, which makes every forward and every
# logits call batch-invariant (a row's result never depends on how many rows share the call), prefill included; the
# engine's seeded and greedy requests rely on it in any batch. float32 is also faster than F.linear at every M (one
# layer's four matmuls of the default target, 2 threads, up to M = 512); bfloat16 costs more than torch's GEMM past
# ~64 rows, which only prefill chunks reach (bench/RESULTS-log.md, "Figures moved out of code comments (2026-11-25)").
MAX_NATIVE_ROWS = {torch.float32: 1 << 62, torch.bfloat16: 1 << 62}


def _native_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether backend=None takes the native kernel: metadata only, no tensor op (a forward makes 57 calls).

    A K mismatch or a 0-d x passes, and the kernel raises on it as F.linear would.
    """
    dtype = x.dtype
    return (
        x.is_cpu
        and dtype in NATIVE_DTYPES
        and weight.is_cpu
        and weight.dtype is dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or (bias.is_cpu and bias.dtype is dtype))
        and x.numel() <= MAX_NATIVE_ROWS[dtype] * weight.shape[1]
    )


def _triton_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the Triton kernel takes these inputs (any device): one dtype it has a configuration for, a 2-d weight
    with contiguous rows, x's K and the bias's N matching it, one device; metadata only (the kernel checks no
    bounds: a K past the weight's rows read past it)."""
    dtype = x.dtype
    return (
        dtype in TRITON_CONFIGS
        and weight.dtype is dtype
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and weight.device == x.device
        and (bias is None or bias.dtype is dtype and bias.shape == weight.shape[:1] and bias.device == x.device)
    )


def _check_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Why backend='native' cannot run these inputs, as a clear error (the C++ op checks the rest)."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cpu:
            raise ValueError(
                f"linear: backend='native' is a CPU kernel but {name} is on {t.device}; use backend=None or 'torch'"
            )
    if x.dtype not in NATIVE_DTYPES:
        raise TypeError(f"linear: backend='native' takes float32 or bfloat16, got x of {x.dtype}; use backend='torch'")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias``, with the semantics of ``F.linear``.

    Parameters
    ----------
    x : Tensor
        ``[..., K]``, float32 or bfloat16 for the native kernel; any strides (rows with unit inner stride are read
        in place, anything else is copied once).
    weight : Tensor or QuantizedWeight
        ``[N, K]``, same dtype as x, contiguous (row-major: the kernel streams each row once). Pass the model's
        ``nn.Linear.weight`` as it is; fused projections are one concatenated ``[N1 + N2, K]`` weight. A
        :class:`~spec_kernels.types.QuantizedWeight` (GGUF blocks) runs :func:`quant_linear` instead.
    bias : Tensor, optional
        ``[N]``, same dtype as x.
    backend : {None, "native", "torch"}
        None: the native kernel on CPU float32 and bfloat16 inputs (any M) with a contiguous weight; on CUDA (and
        meta) the batch-invariant Triton kernel for float32 / float16 / bfloat16 weights with contiguous rows;
        ``F.linear`` otherwise. "native": the C++ kernel, "triton": the Triton kernel (CPU tensors under
        ``TRITON_INTERPRET=1``), each a clear error where it cannot run. "torch": :func:`linear_ref`.

    Returns
    -------
    Tensor
        ``[..., N]`` in x's dtype. The native kernel accumulates in float32 and adds the bias last; bfloat16
        outputs are rounded to nearest even once.

    Raises
    ------
    TypeError, ValueError
        With backend="native": a non-CPU tensor, a dtype other than float32/bfloat16, mismatched dtypes, K or N,
        a non-contiguous weight.

    Shapes
    ------
    - x: ``[..., K]`` (M = prod of the leading dims)
    - weight: ``[N, K]``
    - bias: ``[N]``
    - out: ``[..., N]``
    """
    if isinstance(weight, QuantizedWeight):
        return quant_linear(x, weight.data, weight.qtype, bias=bias, activations=weight.activations, backend=backend)
    if backend is None:
        if _native_fits(x, weight, bias):
            return _native_op()(x, weight, bias)
        if on_device_path(x.device) and triton_available() and _triton_takes(x, weight, bias):
            return linear_triton(x, weight, bias)
        return F.linear(x, weight, bias)
    backend = resolve_backend("linear", backend, x.device)
    if backend == "triton":
        if not _triton_takes(x, weight, bias):
            raise ValueError(f"linear: backend='triton' takes one of float32 / float16 / bfloat16 for x [..., K], "
                             f"weight [N, K] with contiguous rows and bias [N], on one device; got x {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}, weight {weight.dtype} {tuple(weight.shape)} on "
                             f"{weight.device}, bias "
                             f"{None if bias is None else (bias.dtype, tuple(bias.shape), bias.device)}")  # fmt: skip
        return linear_triton(x, weight, bias)
    if backend == "torch":
        return linear_ref(x, weight, bias)
    _check_native(x, weight, bias)
    return _native_op()(x, weight, bias)
