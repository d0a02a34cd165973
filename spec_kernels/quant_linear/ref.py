"""``quant_linear_ref``: the readable spec of ``quant_linear`` (dequantize in float32, ``F.linear``), with its exact
signature. The block format's decoding, ``dequantize_ref``, lives in :mod:`spec_kernels.types` with
``QuantizedWeight``, whose methods use it.

Clarity beats speed here: tests and benchmarks compare against it, and ``backend="torch"`` runs it (the CPU
fallback of last resort).
"""

from __future__ import annotations

import torch

from spec_kernels.types import dequantize_ref


def quant_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: str,
    *,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ dequantize_ref(weight, qtype).T + bias`` in float32, cast to x's dtype. ``backend`` is ignored."""
    w = dequantize_ref(weight, qtype)  # [N, K]
    out = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)
