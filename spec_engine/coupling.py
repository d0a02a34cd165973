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

argmax(log p~ + g) = argmax(z + g) for the filtered scaled logits z (log p~ = z - logsumexp(z)), so nothing
normalises. The target's side runs inside verify_tree (``noise_seeds``, ``positions``, ``coupled``): its kernels
regenerate g_t from (s, t, x) where they read the logits, so no [B, T, V] noise tensor is ever built. The draft's side
is :func:`position_gumbel` (spec_kernels/rng.py), the same noise in torch.
"""

from __future__ import annotations

from spec_kernels.rng import position_gumbel

__all__ = ["position_gumbel"]
