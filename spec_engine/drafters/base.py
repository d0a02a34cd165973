"""The drafter interface: anything that proposes a token tree per sequence each step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from spec_kernels import VerifyResult


@dataclass
class StepBatch:
    """What the engine tells a drafter about the sequences of one step (B rows).

    Shapes:
        seqlens: [B] int32, L_b: committed positions of the target cache
        roots: [B] int64, the last emitted token of each row (not yet in any cache)
        block_table: [B, max_blocks] int32, shared by the target and draft caches
        temperature: [B] float32 (0 = greedy)
    ``requests`` holds the engine's per-request objects (token history, per-request state, RNG).
    ``gammas`` is the tree depth each row asks for this step (0 = no drafting).
    """

    requests: list
    seqlens: torch.Tensor
    roots: torch.Tensor
    block_table: torch.Tensor
    temperature: torch.Tensor
    gammas: list[int]

    @property
    def size(self) -> int:
        return len(self.requests)


@dataclass
class Draft:
    """One step's proposal. ``draft_probs`` is None for deterministic drafts (point-mass proposals).

    Shapes: tokens, parents [B, T] int64 (parents -1 for the root and padding); draft_probs [B, T, V].
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    draft_sampling: str = "iid"


class Drafter(ABC):
    """Proposes trees. Drafters with a KV cache keep it in step with the target's through ``prefill``/``commit``."""

    max_depth: int  # the deepest tree this drafter proposes
    max_nodes: int  # T for a row drafted at max_depth

    def prefill(self, input_ids, positions, seqlens, mask, block_table) -> None:  # noqa: B027
        """See the same prompt chunk the target prefilled. Shapes as ``LlamaForCausalLM.forward``."""

    @abstractmethod
    def propose(self, batch: StepBatch) -> Draft: ...

    def commit(self, batch: StepBatch, result: VerifyResult) -> None:  # noqa: B027
        """Learn which path the target accepted (compact own caches, advance own lengths)."""

    def cache_lag(self, request) -> int:
        """Tokens the drafter's own cache still has to catch up on before it can draft for ``request``."""
        return 0

    def nodes_for_depth(self, depth: int) -> int:
        """T of a tree of the given depth (for KV reservations and cost models)."""
        return depth + 1
