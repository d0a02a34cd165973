"""The target's interface: what the engine and ``LLM`` use of the model whose output they reproduce.

``LlamaForCausalLM`` (one process) and ``spec_engine.distributed.TPTarget`` (rank 0 of a tensor-parallel group)
implement it; the engine reads nothing else of a target.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from spec_engine.models.config import ModelConfig
from spec_kernels.decoder_layers import NativeModel


@runtime_checkable
class Target(Protocol):
    config: ModelConfig
    # the native step ops' handle, built by ``fuse`` (None: every step is a regular one, e.g. under tensor
    # parallelism or off the CPU)
    native: NativeModel | None
    # its forward runs on the device alone, so CUDA graphs may capture it (spec_engine/cuda_graphs.py)
    capturable: bool

    def fuse(self, max_positions: int | None = None) -> Target:
        """Prepare the lean inference path (fused matrices, a RoPE table for positions below ``max_positions``)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 cache_seqlens: torch.Tensor, tree_mask: torch.Tensor,
                 block_table: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The forward: T new tokens per row [B, T] at ``positions`` [B, T] over the cache, their K/V written at
        L_b .. L_b + T - 1; the final hidden states [B, T, H]."""

    def forward_features(self, input_ids, positions, kv_cache, cache_seqlens, tree_mask, block_table=None, *,
                         layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The forward, and the residual streams entering ``layers`` [B, T, len(layers) * H] (EAGLE-3's features)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] float32."""
