"""``fused_elementwise``: a decoder layer's elementwise work between its matmuls and its attention, each piece one
kernel on CUDA: ``add_rms_norm`` (the residual add and the RMSNorm after it), ``silu_mul`` (SiLU of gate times up)
and ``rope_qk`` (rotate-half RoPE of q and k together); and ``softcap``, Gemma 2's final logits (on CPU the C++
function the native step runners apply, so their tokens are a regular step's).

Glossary: a *row* is one token's vector (hidden state, MLP activations, or its q/k heads); M rows in a call.

On CUDA (and meta) tensors backend=None runs the Triton kernels (``spec_kernels.fused_elementwise.triton``); on CPU
tensors the references (the CPU runs the native C++ layers, ``spec_kernels.decoder_layers``, which need none of
these). ``DEVICE_OPS`` is the set the device layer loop runs; ``SPECDEC_FUSED_ELEMENTWISE=0`` makes that loop run the
references instead (the unfused torch ops: the comparison bench/gpu_decode.py times).
"""

from __future__ import annotations

import math
import os

import torch

from spec_kernels._backend import on_device_path, resolve_backend, triton_available
from spec_kernels.fused_elementwise.ref import (
    REFERENCE_OPS,
    ElementwiseOps,
    add_rms_norm_ref,
    rope_qk_ref,
    silu_mul_ref,
    softcap_ref,
)
from spec_kernels.fused_elementwise.triton import add_rms_norm_triton, rms_norm_triton, rope_qk_triton, silu_mul_triton

__all__ = ["DEVICE_OPS", "ElementwiseOps", "add_rms_norm", "layer_ops", "rope_qk", "silu_mul", "softcap"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _pick(op: str, backend: str | None, device: torch.device, takes: bool) -> str:
    """ "triton" or "torch" for this call: None takes Triton on the device path where the kernel takes the inputs."""
    if backend is None:
        return "triton" if on_device_path(device) and triton_available() and takes else "torch"
    if backend == "native":
        raise ValueError(f"{op}: there is no native backend (the CPU runs these inside decoder_layers' C++ op); use "
                         "backend=None, 'triton' or 'torch'")  # fmt: skip
    backend = resolve_backend(op, backend, device)
    if backend == "triton" and not takes:
        raise ValueError(f"{op}: backend='triton' takes float32 / float16 / bfloat16 tensors of one dtype on one "
                         "device, with the shapes of the docstring")  # fmt: skip
    return backend


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it: ``h = x + residual``; ``(rms_norm(h) * weight, h)``.

    vLLM's ``fused_add_rms_norm`` order: x is a block's output, residual the stream it joins. None: h is x (no add,
    no copy). The norm as ``rms_norm_ref``: float32 statistics, the normed row rounded to x's dtype, then times the
    weight (the product in ``result_type(weight, x)``).

    Parameters
    ----------
    x, residual : ``[..., N]``, one dtype; residual may be None.
    weight : ``[N]``.
    eps : the RMSNorm epsilon.
    backend : None (Triton on CUDA / meta, the reference on CPU), "triton" (CPU tensors under
        ``TRITON_INTERPRET=1``), "torch" (``add_rms_norm_ref``).

    Returns
    -------
    (out, h) : ``[..., N]`` each. The Triton kernel sums each row's squares in float32, per lane tile by tile, then
    across lanes: row i is bitwise the 1-row call's, whatever M (the reference's within float32 rounding of the sum).

    Shapes
    ------
    - x, residual, h, out: ``[..., N]`` (M = prod of the leading dims)
    - weight: ``[N]``
    """
    takes = (
        x.dtype in FLOAT_DTYPES
        and weight.dtype in FLOAT_DTYPES
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1]
        and weight.device == x.device
        and (residual is None or (residual.dtype, residual.shape, residual.device) == (x.dtype, x.shape, x.device))
    )
    if _pick("add_rms_norm", backend, x.device, takes) == "torch":
        return add_rms_norm_ref(x, residual, weight, eps)
    if residual is None:
        return rms_norm_triton(x, weight, eps), x
    return add_rms_norm_triton(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` from the fused gate/up matmul's output, gate columns first.

    Each value rounded to gate_up's dtype where torch's two ops round (after the SiLU, after the product).

    Shapes
    ------
    - gate_up: ``[..., 2 I]``
    - out: ``[..., I]``
    """
    takes = gate_up.dtype in FLOAT_DTYPES and gate_up.shape[-1] % 2 == 0
    if _pick("silu_mul", backend, gate_up.device, takes) == "torch":
        return silu_mul_ref(gate_up)
    return silu_mul_triton(gate_up)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q and k in one launch: ``x * cos + rotate_half(x) * sin``, each product and the sum
    rounded to the dtype as the reference's torch ops round (so the kernel equals ``rope_qk_ref`` bit for bit).

    Shapes
    ------
    - q: ``[B, T, Hq, D]``; k: ``[B, T, Hkv, D]`` (views of the qkv matmul's rows are read in place)
    - cos, sin: ``[B, T, D]``
    - returns (q, k) rotated, contiguous, same shapes
    """
    dtype = q.dtype
    takes = (
        dtype in FLOAT_DTYPES
        and k.dtype == cos.dtype == sin.dtype == dtype
        and q.dim() == k.dim() == 4
        and q.shape[:2] == k.shape[:2] == cos.shape[:2] == sin.shape[:2]
        and q.shape[-1] == k.shape[-1] == cos.shape[-1] == sin.shape[-1]
        and q.shape[-1] % 2 == 0
        and q.device == k.device == cos.device == sin.device
    )
    if _pick("rope_qk", backend, q.device, takes) == "torch":
        return rope_qk_ref(q, k, cos, sin)
    return rope_qk_triton(q, k, cos, sin)


def softcap(z: torch.Tensor, cap: float, *, backend: str | None = None) -> torch.Tensor:
    """Soft-capped logits: ``cap * tanh(z / cap)`` in float32, +-inf kept (``softcap_ref``).

    backend None: on CPU float32 / bfloat16 tensors one C++ call ("native": ``spec_kernels::softcap``,
    csrc/layer_ops_cpu.h's ``soft_cap``, Cephes' tanhf within 2 ulp of tanh), the function the native step runners
    apply to a capped model's logits, so their tokens and draws equal a regular step's bit for bit; elsewhere "torch"
    (the reference). There is no Triton kernel.

    Shapes
    ------
    - z: ``[..., V]`` float32 or bfloat16 (any dtype for "torch")
    - out: ``[..., V]`` float32
    """
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"softcap: cap must be finite and > 0, got {cap}")
    takes = z.dtype in (torch.float32, torch.bfloat16)
    if backend is None:
        backend = "native" if takes and z.device.type == "cpu" else "torch"
    if backend not in ("native", "torch"):
        raise ValueError(f"softcap: backend must be None, 'native' or 'torch', got {backend!r}")
    if backend == "torch":
        return softcap_ref(z, cap)
    if not takes or z.device.type not in ("cpu", "meta"):
        raise ValueError(f"softcap: backend='native' takes float32 / bfloat16 CPU (or meta) tensors, got {z.dtype} "
                         f"on {z.device}")  # fmt: skip
    from spec_kernels._ext import load_ext

    load_ext()
    return torch.ops.spec_kernels.softcap(z, float(cap))


DEVICE_OPS = ElementwiseOps(add_rms_norm, silu_mul, rope_qk)


def layer_ops() -> ElementwiseOps:
    """The ops the device layer loop runs: the fused kernels, or the references with ``SPECDEC_FUSED_ELEMENTWISE=0``."""
    return REFERENCE_OPS if os.environ.get("SPECDEC_FUSED_ELEMENTWISE") == "0" else DEVICE_OPS
