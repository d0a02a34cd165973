"""Host -> device copies of a step's small inputs, batched: one copy per dtype, never a sync.

A step's inputs (lengths, roots, block-table rows, sampling parameters, tree shapes) are built on the host from
Python/numpy bookkeeping. Sent one tensor at a time they would cost one copy launch each; packed by dtype into one
staging tensor (pinned on CUDA, so ``non_blocking`` copies overlap the GPU's work) they cost one or two.
"""

from __future__ import annotations

import torch


def to_device(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The host ``tensors`` on ``device``, same shapes and dtypes; on the CPU they are returned as they are."""
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    for idx in groups.values():
        staging = torch.cat([tensors[i].reshape(-1) for i in idx])  # [sum of numels]
        if device.type == "cuda":
            staging = staging.pin_memory()
        flat = staging.to(device, non_blocking=True)
        for i, part in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = part.view(tensors[i].shape)
    return out
