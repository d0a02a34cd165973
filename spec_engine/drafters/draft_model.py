"""A small draft model that proposes chains or static trees, level by level, on its own paged KV cache.

Cache layout mirrors the target's: the root at slot L_b, tree node i at slot L_b + i, so one ``compact_kv_`` with
the target's accepted path compacts it too. The deepest level is never run through the draft model, so after a
step whose path ends there the draft cache lags the target by one token; the next step's first forward
("catch-up") feeds the lagging tokens together with the root. Lag can grow while the row is not drafted.

How children are drawn (``draft_sampling``, one of ``verify_tree``'s modes):
- "without_replacement" (default): Gumbel-top-b of log q for sampled rows, exactly sequential sampling without
  replacement, so siblings are distinct; with "iid" a node's b children often repeat a token and waste a branch.
- "iid": b independent draws from q.
- "deterministic": the b most likely tokens, verified as point-mass proposals (``draft_probs=None``).
Greedy rows always take the b most likely tokens: greedy verification ignores q.
"""

from __future__ import annotations

import torch

from spec_engine.drafters.base import Draft, Drafter, StepBatch
from spec_engine.kv_cache import PagedKVCache
from spec_engine.models import LlamaForCausalLM
from spec_engine.tree import StaticTree, causal_mask, tree_mask
from spec_kernels import PAD_NODE, VerifyResult, compact_kv_

DRAFT_SAMPLING = ("without_replacement", "iid", "deterministic")
CATCH_UP_CHUNK = 128  # tokens per catch-up forward of a long-lagging row (see _catch_up)
CATCH_UP_SLACK = 8  # a row lagging more than this is caught up on its own, not padded into every row


class DraftModelDrafter(Drafter):
    def __init__(self, model: LlamaForCausalLM, kv: PagedKVCache, tree: StaticTree,
                 draft_sampling: str = "without_replacement"):  # fmt: skip
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
        self.model, self.kv, self.tree, self.draft_sampling = model, kv, tree, draft_sampling
        self.max_depth = tree.depth
        self.max_nodes = tree.num_nodes
        self._parents = tree.parents()  # [T_max]
        self._built_depth = 0

    def cache_lag(self, request) -> int:
        return request.num_computed - request.draft_len

    def nodes_for_depth(self, depth: int) -> int:
        return sum(self.tree.level_sizes[: depth + 1])

    def prefill(self, input_ids, positions, seqlens, mask, block_table) -> None:
        self.model(input_ids, positions, self.kv.data, seqlens, mask, block_table)

    def _forward_logits(self, tokens, positions, seqlens, mask, block_table) -> torch.Tensor:
        hidden = self.model(tokens, positions, self.kv.data, seqlens, mask, block_table)  # [B, T, hidden]
        return self.model.logits(hidden)  # [B, T, V]

    def _catch_up(self, batch: StepBatch) -> torch.Tensor:
        """Feed each row's tokens the draft cache lacks, then its root; return q logits at the root [B, V].

        A row that lags by more than ``CATCH_UP_SLACK`` tokens (its prompt, under the adaptive controller, or the
        tokens of a stretch it was left undrafted) is fed first, ``CATCH_UP_CHUNK`` at a time and only on the rows
        that lag that much: no forward is wider than ``CATCH_UP_CHUNK`` tokens, and the other rows are not padded
        to the longest lag. The last forward feeds every row its few remaining tokens and its root."""
        reqs = batch.requests
        while True:
            long = [b for b, r in enumerate(reqs) if self.cache_lag(r) > CATCH_UP_SLACK]
            if not long:
                break
            counts = [min(self.cache_lag(reqs[b]), CATCH_UP_CHUNK) for b in long]
            n = max(counts)
            tokens = torch.zeros(len(long), n, dtype=torch.int64)  # [n_long, n], ragged rows padded at the end
            for i, (b, count) in enumerate(zip(long, counts)):
                cached = reqs[b].draft_len
                tokens[i, :count] = torch.tensor(reqs[b].all_token_ids[cached : cached + count])
            start = torch.tensor([reqs[b].draft_len for b in long], dtype=torch.int32)  # [n_long]
            positions = start.long()[:, None] + torch.arange(n)  # [n_long, n]
            self.model(tokens, positions, self.kv.data, start, causal_mask(len(long), n), batch.block_table[long])
            for b, count in zip(long, counts):
                reqs[b].draft_len += count
        lags = [self.cache_lag(r) for r in reqs]
        T = max(lags) + 1
        tokens = torch.zeros(batch.size, T, dtype=torch.int64)  # [B, T], padded at the end
        for b, (r, lag) in enumerate(zip(reqs, lags)):
            tokens[b, : lag + 1] = torch.tensor(r.all_token_ids[len(r.all_token_ids) - 1 - lag :])
        lag_t = torch.tensor(lags, dtype=torch.int32)
        start = batch.seqlens - lag_t  # [B]: draft committed lengths
        positions = start.long()[:, None] + torch.arange(T)
        hidden = self.model(tokens, positions, self.kv.data, start, causal_mask(batch.size, T), batch.block_table)
        return self.model.logits(hidden[torch.arange(batch.size), lag_t.long()])  # [B, V]: the roots' only

    def propose(self, batch: StepBatch) -> Draft:
        depth = max(batch.gammas)
        T = self.nodes_for_depth(depth)
        B, L = batch.size, batch.seqlens
        levels = self.tree.level_slices
        greedy = batch.temperature == 0  # [B]
        temp = torch.where(greedy, 1.0, batch.temperature)[:, None, None]  # [B, 1, 1]
        tokens = torch.zeros(B, T, dtype=torch.int64)  # [B, T]
        tokens[:, 0] = batch.roots
        logits = self._catch_up(batch)[:, None]  # [B, 1, V]: q logits of level 0
        q = torch.zeros(B, T, logits.shape[-1])  # [B, T, V]
        for d in range(1, depth + 1):
            parent_level, level, b = levels[d - 1], levels[d], self.tree.branching[d - 1]
            q_parent = torch.softmax(logits / temp, dim=-1)  # [B, n_parent, V]
            q[:, parent_level] = q_parent
            tokens[:, level] = self._draw_children(q_parent, b, greedy, batch, self.draft_sampling).flatten(1)
            if d == depth:
                break
            # Levels 1..d through the draft model; the root is already cached at slot L_b, an ancestor of all.
            sub = slice(1, level.stop)
            sub_parents = (self._parents[sub] - 1).expand(B, -1)  # [B, n]: re-rooted at node 1
            mask = tree_mask(torch.where(sub_parents < 0, PAD_NODE, sub_parents))
            if self.tree.is_chain:  # a chain's earlier nodes are all ancestors: keep them as prefix, run one node
                sub, mask = slice(d, d + 1), torch.ones(B, 1, 1, dtype=torch.bool)
            positions = L.long()[:, None] + self._depth(sub)
            out = self._forward_logits(tokens[:, sub], positions, L + sub.start, mask, batch.block_table)
            logits = out[:, level.start - sub.start :]  # [B, n_level, V]
        parents = self._parents[:T].expand(B, T).clone()
        for b, gamma in enumerate(batch.gammas):
            parents[b, self.nodes_for_depth(gamma) :] = PAD_NODE
        self._built_depth = depth
        if self.draft_sampling == "deterministic":
            return Draft(tokens, parents, None, "iid")
        return Draft(tokens, parents, q, self.draft_sampling)

    def _depth(self, sub: slice) -> torch.Tensor:
        sizes = self.tree.level_sizes
        depth = torch.cat([torch.full((n,), d) for d, n in enumerate(sizes)])
        return depth[sub]

    @staticmethod
    def _draw_children(q: torch.Tensor, b: int, greedy: torch.Tensor, batch: StepBatch, mode: str) -> torch.Tensor:
        """[B, n, V] -> [B, n, b]: b children per node, in the order they were drawn."""
        children = q.topk(b, dim=-1).indices  # greedy rows and "deterministic"
        if mode == "deterministic":
            return children
        for row, req in enumerate(batch.requests):
            if greedy[row]:
                continue
            if mode == "iid":
                children[row] = torch.multinomial(q[row], b, replacement=True, generator=req.draft_generator)
            else:
                u = torch.rand(q.shape[1:], generator=req.draft_generator).clamp_(min=1e-20)
                children[row] = (q[row].log() - (-u.log()).log()).topk(b, dim=-1).indices  # Gumbel-top-b
        return children

    def commit(self, batch: StepBatch, result: VerifyResult) -> None:
        compact_kv_(self.kv.planes, batch.seqlens, result.accepted_nodes, result.num_accepted,
                    block_table=batch.block_table)  # fmt: skip
        depths = self._depth(slice(0, None))
        last = result.accepted_nodes.gather(1, (result.num_accepted - 1)[:, None])[:, 0]  # [B]
        ran = depths[last] < self._built_depth  # the draft model ran the last path node: no lag
        new_len = batch.seqlens.long() + result.num_accepted - (~ran).long()
        for req, n in zip(batch.requests, new_len.tolist()):
            req.draft_len = n
