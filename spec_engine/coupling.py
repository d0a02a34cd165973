"""Drafter-invariant sampling: a Gumbel-max coupling keyed by position, so a seeded request's tokens do not depend
on what was drafted, at what depth, or in which batch.

Glossary:
    p~_t        the transformed target distribution at absolute position t (temperature, top-k, top-p, min-p in
                HF's order; zero outside its support): the distribution of the token at t + 1.
    g_t(x)      Gumbel noise for vocabulary entry x at position t of a request with seed s: -log(-log U(s, t, x)),
                U a counter-based uniform (``spec_kernels.rng``), a pure function of (s, t, x).
    coupled     a row sampled as x_{t+1} = argmax_x (log p~_t(x) + g_t(x)): an exact sample from p~_t (the Gumbel-max
                trick), and a deterministic function of (seed, prefix).

Plain decoding of a coupled row takes that argmax at each step. Speculative decoding perturbs the target's logits at
every tree node with the noise of the node's position and verifies greedily: a child is accepted iff it equals the
perturbed argmax, and the token after the accepted path is the perturbed argmax at its end. The emitted tokens are
then the plain coupled output whatever was drafted, and each is still an exact sample given its prefix. The draft
model proposes with the same noise (children = top-b of log q_t + g_t), so it agrees with the target exactly when the
two distributions put the perturbed maximum on the same token: P(accept) >= (1 - TV) / (1 + TV), against 1 - TV for
rejection sampling, so coupling accepts somewhat less.

argmax(log p~ + g) = argmax(z + g) for the filtered scaled logits z (log p~ = z - logsumexp(z)), so nothing here
normalises. Everything is element-wise or a sort per row: no host reads, any device.
"""

from __future__ import annotations

import math

import torch

from spec_kernels import rng


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, T] int64 keys of the noise at ``positions`` [B, T] for rows with request ``seeds`` [B] int64."""
    return rng.mix64(rng.mix64(seeds)[:, None] + positions * rng.GOLDEN)


def position_gumbel(seeds: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """[B, T, V] Gumbel noise g_t(x) for every row and position in ``positions`` [B, T]."""
    B, T = positions.shape
    return rng.gumbel(noise_keys(seeds, positions).reshape(-1), (V,)).view(B, T, V)


def filtered_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """[B, T, V] logits / temperature with -inf outside the support of the transformed distribution.

    HF's order: top-k (ties at the k-th value kept), then top-p (the smallest set, by descending probability, whose
    mass reaches top_p; ties at its last value kept), then min-p (p >= min_p * max p), renormalising in between.
    Rows: temperature [B] > 0, top_k [B] (0 = off), top_p [B] (1 = off), min_p [B] (0 = off)."""
    B, T, V = logits.shape
    z = logits.float() / temperature[:, None, None]  # [B, T, V]
    neg_inf = torch.tensor(-math.inf, device=z.device)
    sorted_z = z.sort(dim=-1, descending=True).values  # [B, T, V]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)[:, None, None].expand(B, T, 1)  # [B, T, 1]
    kth = sorted_z.gather(-1, k - 1)  # [B, T, 1]: the k-th largest
    sorted_z = torch.where(sorted_z >= kth, sorted_z, neg_inf)
    probs = torch.softmax(sorted_z, dim=-1)  # [B, T, V] descending, renormalised after top-k
    before = probs.cumsum(-1) - probs  # mass of the strictly more probable entries
    num_kept = (before < top_p[:, None, None]).sum(-1, keepdim=True).clamp(min=1)  # [B, T, 1]
    num_kept = torch.where(top_p[:, None, None] >= 1, V, num_kept)  # off: float32 sums may reach 1 before the tail
    threshold = torch.maximum(kth, sorted_z.gather(-1, num_kept - 1))  # [B, T, 1]
    z = torch.where(z >= threshold, z, neg_inf)
    # min-p on the renormalised top-p set: p >= min_p * max p  <=>  z >= max z + log(min_p)
    floor = z.amax(-1, keepdim=True) + torch.log(min_p)[:, None, None]  # -inf when min_p = 0
    return torch.where(z >= floor, z, neg_inf)


def perturbed_logits(
    logits: torch.Tensor,
    positions: torch.Tensor,
    seeds: torch.Tensor,
    coupled: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    has_filters: bool = True,
) -> torch.Tensor:
    """[B, T, V] logits whose argmax at each node is the coupled sample there, on the ``coupled`` [B] rows; the
    other rows' logits are returned unchanged. ``positions`` [B, T] are the nodes' absolute positions.
    ``has_filters=False`` (the caller knows no coupled row uses top-k, top-p or min-p) skips the per-node sort."""
    safe_t = torch.where(coupled, temperature, 1.0)  # uncoupled rows may be greedy (temperature 0)
    if has_filters:
        z = filtered_logits(logits, safe_t, top_k, top_p, min_p)
    else:
        z = logits.float() / safe_t[:, None, None]
    z = z + position_gumbel(seeds, positions, logits.shape[-1])
    return torch.where(coupled[:, None, None], z, logits.float())
