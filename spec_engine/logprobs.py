"""Log-probabilities of emitted and prompt tokens under the target's distribution (``SamplingParams.logprobs`` and
``prompt_logprobs``), computed on the device with one host read; spec_engine/server/logprobs.py puts them in OpenAI's
shapes."""

from __future__ import annotations

import torch

from spec_engine.request import TokenLogprobs
from spec_kernels import VerifyResult


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Per row of ``logits`` [N, V]: ``tokens`` [N]'s log-probability and the ``k`` most likely tokens' (one host read),
    log-softmax in float32. Ties go to the lower id: a step reads the batch's largest k and each request keeps the
    first of them, which are then its own top k whatever its neighbours ask (``topk`` picks among ties by k)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = lp.gather(-1, tokens[:, None])[:, 0]  # [N]
    ids = _top_ids(lp, k)  # [N, k]
    both = torch.cat((chosen[:, None], lp.gather(-1, ids)), dim=1).tolist()  # [N, 1 + k]
    return [TokenLogprobs(row[0], top, row[1:]) for row, top in zip(both, ids.tolist())]


def _top_ids(lp: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest entries' ids of each row of ``lp`` [N, V], in order of (value descending, id ascending):
    every one above the k-th value, then the lowest ids of those equal to it. [N, k] int64."""
    N, V = lp.shape
    if k == 0:
        return torch.empty(N, 0, dtype=torch.int64, device=lp.device)
    top = lp.topk(min(k + 1, V), dim=-1)  # [N, k + 1]: the one past the k-th tells a tie across the boundary
    ids = top.indices[:, :k]  # [N, k]: the right set unless a tie crosses the boundary
    if k < V:
        kth = top.values[:, k - 1 : k]  # [N, 1]
        crossing = (top.values[:, k:] == kth)[:, 0]  # [N]
        if bool(crossing.any()):  # those rows take the lowest ids of the tie, in one pass over V each
            z, at = lp[crossing], kth[crossing]  # [n, V], [n, 1]
            above, tied = z > at, z == at
            room = k - above.sum(-1, keepdim=True)  # [n, 1]: the places left to the tie
            keep = above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= room))  # [n, V]: k a row
            ids = ids.clone()
            ids[crossing] = keep.nonzero()[:, 1].view(-1, k)
    ids = ids.sort(dim=-1).values  # [N, k]
    order = lp.gather(-1, ids).sort(dim=-1, descending=True, stable=True).indices  # [N, k]
    return ids.gather(-1, order)


def step_logprobs(
    logits: torch.Tensor, result: VerifyResult, num_accepted: list[int], k: int
) -> list[list[TokenLogprobs]]:
    """Each row's emitted tokens' log-probabilities (``StepResult.logprobs``) from the verify pass's logits
    [B, T, V]: token j of row b is drawn from the distribution at its path's node j (the root's, then each accepted
    draft's); ``num_accepted`` [B] the tokens each row emitted (host)."""
    B, T = result.output_tokens.shape
    nodes = result.accepted_nodes.clamp(min=0)  # [B, T]: padding past num_accepted reads the root, then is dropped
    at = logits[torch.arange(B, device=logits.device)[:, None], nodes]  # [B, T, V]
    rows = token_logprobs(at.flatten(0, 1), result.output_tokens.clamp(min=0).flatten(), k)  # [B * T]
    return [rows[b * T : b * T + n] for b, n in enumerate(num_accepted)]
