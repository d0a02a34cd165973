"""verify_tree's native CPU path: the rows walk their trees in lockstep, one level per step, reading only the
logits rows of the nodes they visit; all-greedy plain steps take the C++ walk (``verify_greedy``)."""

from __future__ import annotations

import torch

from spec_kernels._ext import load_ext
from spec_kernels._sampling import (
    RESIDUAL_EPS,
    Coupling,
    RowParams,
    keep_threshold,
    sample_from_weights,
    scaled_logits,
    transform_probs,
)
from spec_kernels.rng import gumbel, noise_keys, row_uniforms
from spec_kernels.types import PAD_NODE, VerifyResult


def _argmax_rows(z: torch.Tensor) -> torch.Tensor:
    """Sanitised argmax of raw logits rows [N, V] -> [N]; one pass unless a row holds NaN/inf."""
    idx = z.argmax(-1)  # first maximum; NaN counts as the maximum, caught below
    bad = ~torch.isfinite(z.gather(1, idx[:, None]).squeeze(1))
    if bool(bad.any()):
        idx[bad] = scaled_logits(z[bad], torch.ones(int(bad.sum()), device=z.device)).argmax(-1)
    return idx


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual after rejecting x [N, 1]: max(p - q, 0), or p with x zeroed for point masses. [N, V]"""
    return p.scatter_(1, x, 0.0) if q is None else (p - q).clamp_(min=0.0)


def _perturbed(z: torch.Tensor, rows: torch.Tensor, cur: torch.Tensor, params: RowParams, coupling: Coupling):
    """The visited nodes' logits z [N, V] with the coupled rows' replaced by filtered z / temperature + g_t [N, V]
    (float32), the noise regenerated for just these N nodes. ``rows``, ``cur`` [N]: their rows and nodes."""
    idx = coupling.coupled[rows].nonzero().squeeze(1)  # [n]
    if idx.numel() == 0:
        return z
    r, prm = rows[idx], params.rows(rows[idx])
    zc = scaled_logits(z[idx], prm.temperature)  # [n, V]
    if prm.has_filters():
        zc = torch.where(zc >= keep_threshold(zc, prm)[:, None], zc, -torch.inf)
    keys = noise_keys(coupling.noise_seeds[r], coupling.positions[r, cur[idx]][:, None])  # [n, 1]
    return z.float().index_put((idx,), zc + gumbel(keys[:, 0], (z.shape[1],)))  # out of place: z may be a view


def _all_greedy_plain(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, kwargs: dict) -> bool:
    """Whether the one-call C++ walk (``spec_kernels::verify_greedy``) can take this call: CPU float32 logits, int64
    trees, deterministic children, every row greedy (a CPU temperature tensor of zeros, read for free), nothing
    else set (no filters, seed or coupling: they would need validating, and greedy rows ignore them)."""
    temperature = kwargs["temperature"]
    return (
        logits.dtype == torch.float32
        and logits.dim() == 3
        and tokens.dtype == torch.int64
        and parents.dtype == torch.int64
        and kwargs["draft_probs"] is None
        and all(kwargs[k] is None for k in ("top_k", "top_p", "min_p", "seed", "noise_seeds", "positions", "coupled"))
        and isinstance(temperature, torch.Tensor)
        and temperature.is_cpu
        and temperature.shape == logits.shape[:1]
        and not bool(temperature.any())
    )


def _verify_greedy_native(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> VerifyResult | None:
    """verify_tree of an all-greedy batch in one C++ call, about 30x faster at B=1, T=1, V=4096 than the torch-op
    path (checks, argmax, walk: ~30 ops). None when a row needs the general path: a non-finite maximum (which it
    sanitises) or a malformed tree or mismatched shapes (for which it raises the error)."""
    B, T, _ = logits.shape
    if tokens.shape != (B, T) or parents.shape != (B, T) or not (tokens.is_cpu and parents.is_cpu) or B * T == 0:
        return None
    load_ext()
    accepted, output, counts = torch.ops.spec_kernels.verify_greedy(logits, tokens, parents)
    if int(counts.min()) < 1:
        return None
    return VerifyResult(accepted, output, counts)


def _verify_root_greedy(logits: torch.Tensor) -> VerifyResult:
    """Plain greedy decoding (every tree a lone root): the argmax, with no walk (under half a call's cost at B=1)."""
    B = logits.shape[0]
    zeros = torch.zeros(B, 1, dtype=torch.int64, device=logits.device)  # [B, 1]
    return VerifyResult(
        zeros, _argmax_rows(logits[:, 0])[:, None], torch.ones(B, dtype=torch.int64, device=logits.device)
    )


def _verify_tree_native(
    logits: torch.Tensor,  # [B, T, V]
    tokens: torch.Tensor,  # [B, T] int64
    parents: torch.Tensor,  # [B, T] int64
    draft_probs: torch.Tensor | None,  # [B, T, V]
    draft_sampling: str,
    params: RowParams,
    seed: int | torch.Tensor,
    coupling: Coupling | None,
) -> VerifyResult:
    B, T, V = logits.shape
    dev = logits.device
    if isinstance(seed, torch.Tensor):
        u = row_uniforms(seed, T + 1).to(dev)  # [B, T + 1]: per-row streams
        u_final, u_accept = u[:, 0], u[:, 1:]
    else:
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        u_accept = torch.rand(B, T, generator=gen, device=dev)  # [B, T]: node i's accept test
        u_final = torch.rand(B, generator=gen, device=dev)  # [B]: the recovered/bonus token
    accepted_nodes = torch.full((B, T), PAD_NODE, dtype=torch.int64, device=dev)
    output_tokens = torch.full((B, T), PAD_NODE, dtype=torch.int64, device=dev)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=dev)
    accepted_nodes[:, 0] = 0
    node_ids = torch.arange(T, device=dev)
    without_replacement = draft_probs is not None and draft_sampling == "without_replacement"

    walk = params  # coupled rows walk greedily on their perturbed logits
    if coupling is not None:
        walk = params._replace(temperature=params.temperature.masked_fill(coupling.coupled, 0.0))

    rows = torch.arange(B, device=dev)  # rows still walking
    cur = torch.zeros(B, dtype=torch.int64, device=dev)  # their current node
    depth = 0
    while rows.numel() > 0:
        prm = walk.rows(rows)
        row_tokens = tokens[rows]  # [N, T]
        is_child = parents[rows] == cur[:, None]  # [N, T]
        children = torch.where(is_child, node_ids, T).sort(-1).values  # [N, T]: children in index order, then T
        z = logits[rows, cur]  # [N, V]: one read of each visited node's logits
        if coupling is not None:
            z = _perturbed(z, rows, cur, params, coupling)
        nxt = torch.full_like(cur, -1)
        if bool(prm.greedy.all()):
            # greedy needs only the argmax: the first child matching it is the next node
            amax = _argmax_rows(z)
            match = (children < T) & (row_tokens.gather(1, children.clamp(max=T - 1)) == amax[:, None])
            first = children.gather(1, match.to(torch.int8).argmax(-1, keepdim=True)).squeeze(1)
            nxt = torch.where(match.any(-1), first, nxt)
            final = amax
        else:
            p = transform_probs(z, prm)  # [N, V], normalised; greedy rows are one-hot, which greedy needs
            q = draft_probs[rows, cur].float() if draft_probs is not None else None  # [N, V]
            for rank in range(int(is_child.sum(-1).max())):
                child = children[:, rank]
                trying = (child < T) & (nxt < 0)
                child = child.clamp(max=T - 1)
                x = row_tokens.gather(1, child[:, None])  # [N, 1]
                p_x = p.gather(1, x).squeeze(1)
                q_x = q.gather(1, x).squeeze(1) if q is not None else torch.ones_like(p_x)
                accept = trying & (u_accept[rows, child] * q_x < p_x)
                nxt = torch.where(accept, child, nxt)
                rej = (trying & ~accept).nonzero().squeeze(1)
                if rej.numel() == 0:
                    continue
                xr = x[rej]
                residual = _residual(p[rej], None if q is None else q[rej], xr)
                mass = residual.sum(-1, keepdim=True)
                residual /= mass
                lost = (mass <= RESIDUAL_EPS).squeeze(1)
                if bool(lost.any()):  # rounding noise: back to the node's own distribution
                    residual[lost] = transform_probs(z[rej[lost]], prm.rows(rej[lost]))
                p[rej] = residual
                if without_replacement:
                    q_left = q[rej].scatter_(1, xr, 0.0)
                    q_mass = q_left.sum(-1, keepdim=True)
                    q_left /= q_mass
                    lost = (q_mass <= RESIDUAL_EPS).squeeze(1)
                    if bool(lost.any()):
                        q_left[lost] = draft_probs[rows[rej[lost]], cur[rej[lost]]].float()
                    q[rej] = q_left
            final = torch.zeros_like(cur)
            done = nxt < 0
            final[done] = sample_from_weights(p[done], u_final[rows[done]])
        moved = nxt >= 0
        done = ~moved
        output_tokens[rows[done], depth] = final[done]
        num_accepted[rows[done]] = depth + 1
        rows, cur = rows[moved], nxt[moved]
        depth += 1
        if rows.numel() == 0:
            break
        accepted_nodes[rows, depth] = cur
        output_tokens[rows, depth - 1] = tokens[rows, cur]
    return VerifyResult(accepted_nodes, output_tokens, num_accepted)


# --- Triton ----------------------------------------------------------------------------------------------------
