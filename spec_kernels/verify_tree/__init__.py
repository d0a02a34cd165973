"""verify_tree: lossless accept/reject of a token tree against the target (speculative decoding's verify step).

Glossary:
    node        one tree position; node 0 is the root (the last emitted token, never verified). ``parents[b, i]``
                is i's parent, -1 for the root and for padding. ``target_logits[b, i]`` predicts i's children.
    p, q        the transformed target distribution and the draft distribution at the current node.
    accept test child x is accepted with probability min(1, p(x) / q(x)), written ``u * q(x) < p(x)`` for a
                uniform u, which also covers q(x) = 0 (accept iff p(x) > 0).
    residual    after a rejected sibling x, the next sibling is judged against norm(max(p - q, 0)); with
                draft_probs=None (point-mass proposals) that is p with x zeroed. Without replacement, the
                draft also loses x: q <- norm(q with x zeroed).
    recovered / bonus   the one token sampled after the accepted path: from the residual when every child of
                the last accepted node was rejected, from p when that node is a leaf.
    transform   HF-order temperature / top-k / top-p / min-p; exact definitions in spec_kernels/_sampling.py.

Backends (dispatch in :func:`verify_tree` only, here; one module each):
    "torch"   verify_tree_ref (spec_kernels/verify_tree/ref.py): python loops, float64.
    "native"  the CPU path (``cpu.py``): every sequence walks in lockstep, one tree level per step, and reads only
              the logits rows of the nodes it visits: one transform pass per visited node plus one pass per
              rejected sibling (draft_probs only), plus one inverse-CDF pass for the final token.
    "triton"  (``triton.py``) one program per sequence walks its whole tree inside the kernel, tiled over V
              (BLOCK_V), with the top-k/top-p thresholds found by bisection over the float bit patterns (no sort),
              and Philox streams keyed by a per-row seed drawn from ``seed``.

Coupled rows (``noise_seeds``/``positions``/``coupled``; spec_engine/coupling.py): at each visited node the row's
token is argmax_x (z(x) + g_t(x)), z the filtered scaled logits (-inf outside the support) and g_t the Gumbel noise
of the node's position t (spec_kernels/rng.py), and the walk is greedy on those tokens. Every backend regenerates
g_t from (seed, t, x) where it reads the logits (native: per visited node; Triton: per tile, in registers), so no
[B, T, V] noise tensor exists.
"""

from __future__ import annotations

import torch

from spec_kernels._backend import resolve_backend
from spec_kernels._sampling import check_coupling_args, check_seed, check_verify_tree_args, filters_given
from spec_kernels.types import PAD_NODE, VerifyResult
from spec_kernels.verify_tree.cpu import (
    _all_greedy_plain,
    _perturbed,
    _verify_greedy_native,
    _verify_root_greedy,
    _verify_tree_native,
)
from spec_kernels.verify_tree.ref import verify_tree_ref
from spec_kernels.verify_tree.triton import _philox_keys

__all__ = ["PAD_NODE", "VerifyResult", "verify_tree", "verify_tree_ref"]


def verify_tree(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    draft_sampling: str = "iid",
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    noise_seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    coupled: torch.Tensor | None = None,
    backend: str | None = None,
) -> VerifyResult:
    """Verify one step's token trees against the target: accept a path from each root, then add one token.

    The emitted tokens are distributed exactly as sampling the transformed target autoregressively, provided
    each node's children were drawn from ``draft_probs`` as ``draft_sampling`` says (or are deterministic when
    ``draft_probs`` is None). Greedy rows (temperature 0) follow the children equal to the target argmax.

    Parameters
    ----------
    target_logits : the target's logits at each node, predicting that node's children.
    draft_tokens : node tokens; the root's (node 0) is the last emitted token and is not verified.
    parents : parent of each node, -1 for the root and for padding nodes (ignored); ``parents[:, i] < i``.
    draft_probs : the draft distribution at each node, or None for deterministic (point-mass) children.
    draft_sampling : "iid" (independent, with replacement) or "without_replacement".
    temperature, top_k, top_p, min_p : per-row sampling parameters (scalars broadcast); None = 1, 0, 1, 0.
        temperature 0 is greedy, top_k 0 and top_p 1 and min_p 0 are off.
    seed : rows draw independent streams from it; the same seed on the same backend gives bitwise the same
        result. None draws a fresh seed. A [B] integer tensor gives each row its own seed (an extension of the
        contract): row b's randomness then depends on seed[b] alone, not on the batch it sits in.
    noise_seeds, positions, coupled : the position-keyed Gumbel coupling (an extension of the contract; all None:
        off). On the ``coupled`` rows (None: every row; greedy rows never are), the token at a node of absolute
        position t is argmax_x (z(x) + g_t(x)): z the transformed target's filtered scaled logits (-inf outside its
        support), g_t(x) = ``spec_kernels.rng.position_gumbel(noise_seeds, t, V)``, generated in the kernel. The
        row then walks greedily on those tokens (``seed`` plays no part in it): its output is a function of
        (noise seed, positions, logits) only, whatever was drafted.
    backend : None (Triton on CUDA and meta tensors, native on CPU), "torch", "native" or "triton".

    On CUDA the Triton path never syncs with the host: shapes, dtypes and devices are checked for free, value checks
    are queued or debug-only (see ``check_verify_tree_args``), and every tensor argument (per-row parameters and
    seeds included) must be on target_logits' device. Meta tensors take the same path and get fake outputs.

    Returns
    -------
    VerifyResult(accepted_nodes, output_tokens, num_accepted), all int64.

    Shapes
    ------
    target_logits [B, T, V], draft_tokens [B, T], parents [B, T], draft_probs [B, T, V], noise_seeds [B] int,
    positions [B, T] int, coupled [B] bool ->
    accepted_nodes [B, T] (path from the root, padded with PAD_NODE), output_tokens [B, T] (accepted drafts, then
    the recovered/bonus token, padded with -1), num_accepted [B] (path length incl. the root = tokens emitted).
    """
    kind = resolve_backend("verify_tree", backend, target_logits.device)
    if kind == "native" and target_logits.device.type == "meta":
        raise RuntimeError(
            "verify_tree: backend='native' reads values on the host; meta tensors stand in for CUDA: use backend=None "
            "or 'triton'"
        )
    args = (target_logits, draft_tokens, parents)
    kwargs = dict(
        draft_probs=draft_probs,
        draft_sampling=draft_sampling,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        noise_seeds=noise_seeds,
        positions=positions,
        coupled=coupled,
    )
    if kind == "torch":
        return verify_tree_ref(*args, **kwargs)
    if kind == "native" and _all_greedy_plain(target_logits, draft_tokens, parents, kwargs):
        result = _verify_greedy_native(target_logits, draft_tokens, parents)
        if result is not None:
            return result
    parents64, params = check_verify_tree_args(
        target_logits, draft_tokens, parents, draft_probs, draft_sampling, temperature, top_k, top_p, min_p
    )
    coupling = check_coupling_args(target_logits, noise_seeds, positions, coupled, params.temperature)
    seed = check_seed(seed, target_logits.shape[0])
    if seed is None:
        seed = int(torch.randint(2**62, ()))
    tokens = draft_tokens.to(torch.int64)
    if kind == "native":
        walks_greedy = params.greedy if coupling is None else params.greedy | coupling.coupled
        if target_logits.shape[1] == 1 and bool(walks_greedy.all()):
            if coupling is not None:  # plain coupled decoding: the perturbed argmax is the token
                rows = torch.arange(target_logits.shape[0])
                target_logits = _perturbed(target_logits[:, 0], rows, torch.zeros_like(rows), params, coupling)[:, None]
            return _verify_root_greedy(target_logits)
        args = (target_logits, tokens, parents64, draft_probs, draft_sampling, params, seed, coupling)
        return _verify_tree_native(*args)
    out = torch.ops.spec_kernels.verify_tree_triton(
        target_logits,
        tokens,
        parents64,
        draft_probs,
        draft_sampling == "without_replacement",
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        _philox_keys(seed, target_logits.shape[0], target_logits.device),
        filters_given(top_k, top_p, min_p),
        *(coupling or (None, None, None)),
    )
    return VerifyResult(*out)
