"""The readable specs of the fused elementwise ops (``add_rms_norm_ref``, ``silu_mul_ref``, ``rope_qk_ref``,
``softcap_ref``), each with its op's exact signature, and the two building blocks every Llama-family layer loop
shares (``rms_norm_ref``, ``rope_ref``).

Clarity beats speed here: tests and benchmarks compare against them, ``backend="torch"`` runs them, and
``decoder_layers_ref`` (the loop's reference) is written with them. Each rounds to the model's dtype exactly where the
unfused torch ops do, so the Triton kernels can match them bit for bit wherever no reduction is involved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: float32 statistics (fp16/bf16 variance underflows on long rows), then the weight in x's dtype."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return weight * normed


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x ``[B, T, H, D]``; cos, sin ``[B, T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (x alone when residual is None), then ``(rms_norm_ref(h, weight, eps), h)``.
    ``backend`` is ignored. See ``spec_kernels.fused_elementwise.add_rms_norm``."""
    h = x if residual is None else x + residual
    return rms_norm_ref(h, weight, eps), h


def silu_mul_ref(gate_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2 I]`` (gate columns first): ``[..., I]``. ``backend`` is ignored."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_qk_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on q ``[B, T, Hq, D]`` and k ``[B, T, Hkv, D]`` with cos, sin ``[B, T, D]``.
    ``backend`` is ignored."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [B, T, 1, D]
    return rope_ref(q, cos, sin), rope_ref(k, cos, sin)


def softcap_ref(z: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(z / cap)`` of logits ``z [..., V]`` in float32: Gemma 2's final logits as HF computes them,
    except that +-inf stays itself (-inf outside a restricted vocabulary stays -inf)."""
    z = z.float()
    return torch.where(z.isinf(), z, torch.tanh(z / cap) * cap)


class ElementwiseOps(NamedTuple):
    """The elementwise work a layer loop runs between its matmuls and its attention, as one set of functions with
    the signatures above: ``REFERENCE_OPS`` (the references), or the fused kernels on the device path."""

    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    rope_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]]


REFERENCE_OPS = ElementwiseOps(add_rms_norm_ref, silu_mul_ref, rope_qk_ref)
