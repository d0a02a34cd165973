"""EAGLE-2's dynamic tree, one level at a time: the rule the native steps mirror bit for bit
(``HeadDraft::dynamic_tree``, csrc/head_draft_cpu.h) and ``EagleDrafter._dynamic_levels`` runs as torch ops.

Glossary:
    path score  a node's cumulative log-softmax of the logits its children were ranked on, along its path from the
                root: the head's logits z on a greedy row (the path's log q); on a coupled sampled row the level's
                perturbed logits (``perturbed``)
    perturbed   z + t g_p = t (z / t + g_p), g_p the position-keyed coupling's noise at the position p the level's
                children are sampled at (spec_engine/coupling.py): its argmax is the coupled draw, its top-k a
                Gumbel-top-k draw without replacement, and its softmax, were the head the target up to an error of
                the greedy rule's scale (logit units), the chance that the coupled walk takes each child given the
                noise it will use; t to 0 gives the greedy row's rule (softmax of z / t + g, the error scaled by t,
                ranks the same children and kept a little fewer tokens a step: docs/ENGINE.md, "Tree width")
"""

from __future__ import annotations

import torch


def dynamic_level(logits: torch.Tensor, parent_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """One level of EAGLE-2's dynamic tree: the k best children of a level's n nodes, best first, by path score. The
    one rule the native steps mirror bit for bit (``HeadDraft::dynamic_tree``, csrc/head_draft_cpu.h).

    A child's path score is its parent's plus its token's log q, in float32: log q = (z - max z) - lse, lse the log of
    the sum of exp(z - max z) taken in float64 and rounded to float32 (the two sides sum in other orders with other
    exps, which part in a double's last bits: rounded, those reach a score only where lse lies that close to a float32
    rounding boundary); a NaN score is -inf. Ties go to the lower parent, then the lower token id: stable sorts,
    as ``topk`` leaves the order of equals undefined.

    Shapes: logits [B, n, V] float32 (the n nodes' draft logits), parent_scores [B, n]; returns (path scores, parent
    index among the n, token id), each [B, k].
    """
    shifted = logits - logits.amax(-1, keepdim=True)  # [B, n, V]
    lse = shifted.double().exp().sum(-1, keepdim=True).log().float()  # [B, n, 1]
    scores = parent_scores[..., None] + (shifted - lse)
    scores = scores.masked_fill(scores.isnan(), float("-inf"))
    values, ids = scores.sort(dim=-1, descending=True, stable=True)
    values, ids = values[..., :k].flatten(1), ids[..., :k].flatten(1)  # [B, n * k]: each node's k best children
    best, index = values.sort(dim=-1, descending=True, stable=True)
    best, index = best[:, :k], index[:, :k]  # [B, k]: the level's k best
    return best, index // k, ids.gather(1, index)


def mask_level(mask: torch.Tensor, parents: torch.Tensor, level: slice, eye: torch.Tensor) -> None:
    """A dynamic tree's mask [B, T, T] at one level's nodes, in place: each sees its parent's ancestors and itself."""
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None]  # [B, 1]
    mask[:, level] = mask[rows, parents[:, level]] | eye[level]


def perturbed(logits: torch.Tensor, inv_temp: torch.Tensor, noise: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A level's logits [B, n, V] with each coupled row's (``inv_temp`` s [B] > 0) perturbed, (z * s + g) / s, in
    float32 as the native steps compute them; ``noise`` [B, K] the level's Gumbel noise over the draft vocabulary's
    target ids ``ids`` [K] (outside it: -inf, as the head's logits there). Other rows' logits as they are."""
    s = inv_temp[:, None, None]  # [B, 1, 1]
    g = logits.new_full((logits.shape[0], 1, logits.shape[-1]), float("-inf"))  # [B, 1, V]
    g[:, 0, ids] = noise
    return torch.where(s > 0, (logits * s + g) / s, logits)
