"""``linear_ref``: the readable spec of ``linear`` (``F.linear`` itself), with its exact signature.

Clarity beats speed here: tests and benchmarks compare against it, and ``backend="torch"`` runs it (the CPU
fallback of last resort).
"""

from __future__ import annotations

import torch

from spec_kernels.quant_linear.ref import quant_linear_ref
from spec_kernels.types import QuantizedWeight


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias``: ``F.linear`` itself, ``[..., K] x [N, K] -> [..., N]`` (a ``QuantizedWeight``:
    ``quant_linear_ref``). ``backend`` is ignored."""
    if isinstance(weight, QuantizedWeight):
        return quant_linear_ref(x, weight.data, weight.qtype, bias=bias)
    return torch.nn.functional.linear(x, weight, bias)
