"""The hybrid drafter: per row and step, suffix decoding's speculation where it predicts more accepted tokens than
the model drafter (a draft model or an EAGLE head), the model drafter elsewhere.

The comparison starts from expected accepted drafted tokens. The suffix side's is its speculation's score (the sum
of its nodes' estimated probabilities, ``spec_engine.drafters.suffix_ref``) times what such scores kept on the request
(``RowView.score_trust``); the model side's is the adaptive controller's estimate at the gamma it chose for the
row, sum_{d<=gamma} prod_{j<=d} alpha_j (``AdaptiveController.expected_accepted``, handed over as ``gains``: 0 where
it chose not to draft), or, without the controller, sum_{d<=gamma} FIXED_ALPHA^d.
Where the controller prices steps (batch 1), the two are compared as rates, tokens per second, each step at its
measured price (``faster``): on a CPU a wide suffix tree's verify costs r(T) of a token, several where r climbs
(bench/RESULTS-log.md, "the hybrid's choice as a rate"), so more tokens can be slower than the model's chain.
The controller goes on pricing the model drafter from the rows the model drafts; the suffix rows teach it
nothing.

One step's rows may mix the two: the model drafter runs on its rows only, the suffix speculations fill the others,
and the step's tree is as wide as the widest row (the rest padding). The model drafter's cache skips the suffix
rows' steps: their draft length is unchanged, so the cache lags and the model's next draft of the row first feeds it
the tokens it missed (the catch-up every draft model does after undrafted steps). An EAGLE head sees every row's
features each step anyway (``needs_hidden``), the suffix rows' as undrafted rows'.

Sampled rows: a suffix speculation is deterministic, a point-mass proposal. Where the model's rows bring draft
distributions (``draft_probs``), the whole step is verified as drawn from them, so a sampled suffix row is a chain
whose every node carries a one-hot distribution on its token: drawing from it is that token, and verifying the draw
is verifying the point mass. (A branching node cannot be written so: two distinct children are never two draws
from one one-hot distribution.)
"""

from __future__ import annotations

import torch

from spec_engine.drafters.base import Draft, Drafter, DraftPlan, RowView, StepBatch
from spec_engine.drafters.suffix import SuffixDrafter, draft_tensors, trusted_score
from spec_engine.drafters.suffix_ref import SuffixDraft
from spec_kernels import PAD_NODE, VerifyResult
from spec_kernels.decoder_layers import NativeHead, NativeModel

FIXED_ALPHA = 0.6  # the model drafter's acceptance per token assumed without the adaptive controller's estimate


class HybridDrafter(Drafter):
    """``model`` (a ``DraftModelDrafter`` or ``EagleDrafter``) and ``suffix`` (a ``SuffixDrafter``), chosen per row.

    ``num_speculative_tokens`` (the engine's depth) is the model drafter's; the suffix speculation's nodes are capped
    by ``suffix.max_gamma``."""

    plans = True

    def __init__(self, model: Drafter, suffix: SuffixDrafter):
        self.model, self.suffix = model, suffix
        self.max_gamma = max(model.max_gamma, suffix.max_gamma)
        self.max_nodes = max(model.max_nodes, suffix.max_nodes)
        self.tree = model.tree
        self.kv = model.kv  # the model drafter's cache: native chains write it on steps without suffix rows
        self.features = model.features
        self.keeps_cache = model.keeps_cache
        self.needs_hidden = model.needs_hidden
        self.target_layers = model.target_layers
        self.plain_chain_cap = suffix.plain_chain_cap
        self.widths = model.widths  # (the controller's width choice is the model drafter's: a head's trees)

    def tree_for(self, width: int):
        return self.model.tree_for(width)

    def use_graphs(self, enforce_eager: bool, mechanism: str | None = None, *, table_width: int,
                   max_rows: int) -> None:  # fmt: skip
        self.model.use_graphs(enforce_eager, mechanism, table_width=table_width, max_rows=max_rows)

    @property
    def graphs(self):
        return self.model.graphs

    @property
    def native(self) -> NativeModel | NativeHead | None:
        return self.model.native  # (the engine runs native chains only on steps without suffix rows)

    def prefill(self, input_ids, positions, cache_seqlens, mask, block_table, hidden=None) -> None:
        self.model.prefill(input_ids, positions, cache_seqlens, mask, block_table, hidden)

    def store_features(self, positions, block_table, hidden) -> None:
        self.model.store_features(positions, block_table, hidden)

    def finish_request(self, row: RowView) -> None:
        self.model.finish_request(row)
        self.suffix.finish_request(row)

    def _budget(self, row: RowView) -> int:
        """A row's suffix speculation's nodes: the suffix drafter's most, or the drafted tokens the row can keep."""
        return min(self.suffix.max_gamma, row.draft_room)

    def _speculate(self, row: RowView) -> SuffixDraft:
        # sampled rows: chains (see the module docstring); greedy rows: the suffix drafter's own choice
        return self.suffix.speculate(row, self._budget(row), tree=None if row.greedy else False)

    def plan(self, rows: list[RowView], gammas: list[int], gains: list[float] | None = None,
             faster=None) -> DraftPlan:  # fmt: skip
        if gains is None:
            gains = [sum(FIXED_ALPHA**d for d in range(1, gamma + 1)) for gamma in gammas]
        drafts = [self._speculate(r) for r in rows]
        scores = [trusted_score(d, r) for d, r in zip(drafts, rows)]
        # where steps are priced, the faster step in tokens per second (a wide suffix tree costs r(T) of a token:
        # more tokens than the model's chain can still be slower); else the more tokens expected
        beats = [faster(b, len(d.tokens) + 1, 1.0 + s) if faster is not None else s > gain
                 for b, (d, s, gain) in enumerate(zip(drafts, scores, gains))]  # fmt: skip
        suffix_rows = [(s >= self.suffix.min_score or d.sure) and s > 0 and x for s, d, x in zip(scores, drafts, beats)]
        out = [self._budget(r) if s else gamma for s, gamma, r in zip(suffix_rows, gammas, rows)]
        nodes = [len(d.tokens) + 1 if s else self.model.nodes_for_gamma(gamma) if gamma else 1
                 for d, s, gamma in zip(drafts, suffix_rows, gammas)]  # fmt: skip
        expected = [x if s else gain if gamma else 0.0 for x, s, gamma, gain in zip(scores, suffix_rows, gammas, gains)]
        return DraftPlan(out, suffix_rows, nodes, expected, [d.sure and s for d, s in zip(drafts, suffix_rows)])

    def propose(self, batch: StepBatch) -> Draft:
        flags = batch.suffix_rows or [False] * batch.size
        model_rows = [b for b, s in enumerate(flags) if not s]
        if not any(flags):
            return self.model.propose(batch)
        dev = batch.roots.device
        drafts = [self._speculate(r) if s else SuffixDraft() for r, s in zip(batch.rows, flags)]
        sub = None
        if model_rows:
            index = torch.tensor(model_rows, dtype=torch.int64, device=dev)
            sub = self.model.propose(batch.select(model_rows, index))  # [B_m, T_m]
        T = max(len(d.tokens) + 1 for d in drafts)
        if sub is not None:
            T = max(T, sub.tokens.shape[1])
        tokens, parents, mask, depths = draft_tensors(drafts, dev, width=T)  # suffix rows; model rows overwritten
        tokens[:, 0] = batch.roots
        probs = None
        if sub is not None:
            Tm = sub.tokens.shape[1]
            tokens[index, :Tm] = sub.tokens
            parents[index] = PAD_NODE
            parents[index, :Tm] = sub.parents
            mask[index] = torch.eye(T, dtype=torch.bool, device=dev)
            mask[index, :Tm, :Tm] = sub.tree_mask
            depths[index] = 0
            depths[index, :Tm] = sub.depths
            if sub.draft_probs is not None:
                probs = sub.draft_probs.new_zeros(batch.size, T, sub.draft_probs.shape[-1])  # [B, T, V]
                probs[index, :Tm] = sub.draft_probs
                one_hot_proposals(probs, drafts)
        return Draft(tokens, parents, mask, depths, probs, sub.draft_sampling if sub is not None else "iid")

    def commit(self, batch: StepBatch, result: VerifyResult, num_accepted: list[int], hidden=None) -> list[int]:
        """The model drafter's commit over its own rows; a suffix row's draft cache is unchanged (it lags)."""
        flags = batch.suffix_rows or [False] * batch.size
        if self.model.needs_hidden:  # every row's features, suffix rows as undrafted ones
            gammas = [0 if s else gamma for s, gamma in zip(flags, batch.gammas)]
            return self.model.commit(_with_gammas(batch, gammas), result, num_accepted, hidden)
        lens = [r.draft_len for r in batch.rows]
        rows = [b for b, s in enumerate(flags) if not s]
        if not rows:
            return lens
        if len(rows) == batch.size:
            return self.model.commit(batch, result, num_accepted)
        index = torch.tensor(rows, dtype=torch.int64, device=batch.roots.device)
        sub = self.model.commit(batch.select(rows, index), VerifyResult(*(x[index] for x in result)),
                                [num_accepted[b] for b in rows])  # fmt: skip
        for b, n in zip(rows, sub or []):
            lens[b] = n
        return lens


def one_hot_proposals(probs: torch.Tensor, drafts: list[SuffixDraft]) -> None:
    """Write each suffix speculation's point masses into ``probs`` [B, T, V] (in place): a node (column i + 1) was
    drawn at its parent's column, so that column's distribution is one-hot on it (greedy rows' trees too, whose q
    verification ignores)."""
    for b, d in enumerate(drafts):
        for t, p in zip(d.tokens, d.parents):
            probs[b, p + 1, t] = 1.0


def _with_gammas(batch: StepBatch, gammas: list[int]) -> StepBatch:
    return StepBatch(batch.rows, batch.cache_seqlens, batch.roots, batch.block_table, batch.temperature, batch.keys,
                     gammas, batch.coupled, batch.noise_seeds, batch.suffix_rows, batch.width)  # fmt: skip
