"""``verify_tree_ref``: the readable spec of ``verify_tree``, python loops over rows, nodes and siblings in float64,
with its exact signature.

Clarity beats speed here: tests and benchmarks compare against it, and ``backend="torch"`` runs it (the CPU
fallback of last resort).
"""

from __future__ import annotations

import math

import torch

from spec_kernels._sampling import RESIDUAL_EPS, check_coupling_args, check_seed, check_verify_tree_args
from spec_kernels.rng import position_gumbel
from spec_kernels.types import PAD_NODE, VerifyResult


def _transform_row_ref(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """One node's logits [V] -> its transformed target distribution [V] float64 (greedy: one-hot argmax).

    HF order: logits / temperature, top-k (ties kept), top-p, min-p, renormalising after each. See
    spec_kernels/_sampling.py for the exact filter definitions and the NaN/inf sanitising.
    """
    z = logits.double() / (temperature if temperature > 0 else 1.0)
    z = torch.nan_to_num(z, nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    if bool((z == -math.inf).all()):
        z = torch.zeros_like(z)  # nothing finite: uniform, greedy id 0
    if temperature == 0:
        return torch.nn.functional.one_hot(z.argmax(), z.numel()).double()
    neg_inf = torch.tensor(-math.inf, dtype=z.dtype)
    if 0 < top_k < z.numel():
        kth = torch.sort(z, descending=True).values[top_k - 1]
        z = torch.where(z >= kth, z, neg_inf)
    if top_p < 1:
        p = torch.softmax(z, -1)
        p_sorted = torch.sort(p, descending=True).values
        mass_before = torch.cumsum(p_sorted, 0) - p_sorted
        smallest_kept = p_sorted[mass_before < top_p][-1]
        z = torch.where(p >= smallest_kept, z, neg_inf)
    if min_p > 0:
        p = torch.softmax(z, -1)
        z = torch.where(p >= min_p * p.max(), z, neg_inf)
    return torch.softmax(z, -1)


def verify_tree_ref(
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
    """Reference verify_tree: python loops over rows, nodes and siblings, float64. See spec_kernels.verify_tree.

    A coupled row's token at each node is the Gumbel-max sample argmax_x (log p~(x) + g(x)) with the noise of
    ``spec_kernels.rng.position_gumbel`` at the node's position; the row then walks greedily on those tokens."""
    parents, params = check_verify_tree_args(
        target_logits, draft_tokens, parents, draft_probs, draft_sampling, temperature, top_k, top_p, min_p
    )
    coupling = check_coupling_args(target_logits, noise_seeds, positions, coupled, params.temperature)
    B, T, V = target_logits.shape
    seed = check_seed(seed, target_logits.shape[0])
    gen = torch.Generator()
    gen.manual_seed(seed if isinstance(seed, int) else int(torch.randint(2**62, ())))
    accepted_nodes = torch.full((B, T), PAD_NODE, dtype=torch.int64)
    output_tokens = torch.full((B, T), PAD_NODE, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int64)
    logits, tokens, par = target_logits.cpu(), draft_tokens.cpu().tolist(), parents.cpu().tolist()
    if coupling is not None:
        coupling = type(coupling)(*(x.cpu() for x in coupling))
    probs = draft_probs.cpu().double() if draft_probs is not None else None
    for b in range(B):
        if isinstance(seed, torch.Tensor):  # per-row seeds: row b's stream depends on seed[b] alone
            gen.manual_seed(int(seed[b]))
        t, k, tp, mp = (
            float(params.temperature[b]),
            int(params.top_k[b]),
            float(params.top_p[b]),
            float(params.min_p[b]),
        )
        is_coupled = coupling is not None and bool(coupling.coupled[b])
        path, node = [0], 0
        while True:
            p_node = _transform_row_ref(logits[b, node], t, k, tp, mp)
            children = [i for i in range(node + 1, T) if par[b][i] == node]
            if is_coupled:
                # the Gumbel-max sample at this node, with the noise of its position; the walk is then greedy
                g = position_gumbel(coupling.noise_seeds[b, None], coupling.positions[b, None, node, None], V)
                final = int((torch.log(p_node) + g[0, 0].double()).argmax())
                accepted = next((i for i in children if tokens[b][i] == final), None)
                if accepted is None:
                    break
                path.append(accepted)
                node = accepted
                continue
            q_node = probs[b, node] if probs is not None else None
            p, q = p_node, q_node
            accepted = None
            for child in children:
                x = tokens[b][child]
                q_x = 1.0 if q is None else float(q[x])  # draft_probs=None: a point-mass proposal
                u = float(torch.rand((), generator=gen, dtype=torch.float64))
                if u * q_x < float(p[x]):  # accept with probability min(1, p(x) / q(x))
                    accepted = child
                    break
                # rejected: the next sibling is judged against the residual norm(max(p - q, 0))
                if q is None:
                    residual = p.clone()
                    residual[x] = 0.0
                else:
                    residual = torch.clamp(p - q, min=0.0)
                p = residual / residual.sum() if residual.sum() > RESIDUAL_EPS else p_node
                if q is not None and draft_sampling == "without_replacement":
                    q = q.clone()
                    q[x] = 0.0  # the next sibling was drawn from the draft without x
                    q = q / q.sum() if q.sum() > RESIDUAL_EPS else q_node
            if accepted is None:
                # recovered (a child was rejected) or bonus (leaf) token, from the current residual
                final = int(torch.multinomial(p, 1, generator=gen))
                break
            path.append(accepted)
            node = accepted
        n = len(path)
        accepted_nodes[b, :n] = torch.tensor(path)
        output_tokens[b, : n - 1] = torch.tensor([tokens[b][i] for i in path[1:]], dtype=torch.int64)
        output_tokens[b, n - 1] = final
        num_accepted[b] = n
    dev = target_logits.device
    return VerifyResult(accepted_nodes.to(dev), output_tokens.to(dev), num_accepted.to(dev))
