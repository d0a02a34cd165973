"""The drafter interface: anything that proposes a token tree per sequence each step.

Data flows one way (docs/ARCHITECTURE.md): the engine hands a drafter a ``StepBatch`` (device tensors plus a
read-only ``RowView`` per row), the drafter returns a ``Draft``; after verification the engine calls ``commit``, and
the drafter returns the new lengths of its own cache, which the engine stores. A drafter keeps no per-request state
and nothing between ``propose`` and ``commit``, beyond its own caches: a draft model's KV cache, a suffix drafter's
trees (indexed from the rows' token views, forgotten at ``finish_request``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from spec_engine.kv_cache import PagedKVCache
from spec_kernels import PAD_NODE, VerifyResult
from spec_kernels.decoder_layers import NativeHead, NativeModel


@dataclass(frozen=True)
class RowView:
    """What a drafter may read of one request (host values; never written).

    ``token_ids`` is a read-only view of the request's tokens, prompt then output, ending with the root:
    ``len(token_ids) == cache_seqlen + 1`` in a decode step; its first ``num_prompt_tokens`` are the prompt.
    ``draft_len`` is the length of the drafter's own cache for this request, as its last ``commit`` (or prefill) left
    it. ``key`` names the request for as long as the engine lives (never reused): a drafter's per-request cache
    entries are keyed by it. ``score_trust``: how far this request's suffix speculations kept what their scores
    promised (accepted / expected, ``spec_engine.request.ScoreTrust``): a drafter that plans by scores scales them by
    it. ``coupled``: sampled through the position-keyed coupling (``SamplingParams.coupled``): its draws are the
    coupling noise's, never free ones. ``forced``: where the request's grammar (``SamplingParams.guided_json`` ...)
    allows one way on, its tokens (``GrammarState.forced``): suffix speculation drafts them. ``draft_room``: the
    drafted tokens the request can still keep (its tokens left but the one every step emits): a deeper draft is
    verified for nothing.
    """

    token_ids: np.ndarray
    cache_seqlen: int
    draft_len: int
    greedy: bool
    key: int = 0
    num_prompt_tokens: int = 0
    score_trust: float = 1.0
    coupled: bool = False
    forced: tuple[int, ...] = ()  # the tokens its structured-output grammar forces after the root (a sure draft)
    draft_room: int = 1 << 30


@dataclass
class StepBatch:
    """What the engine tells a drafter about the sequences of one step (B rows). Tensors are on the model's device.

    Shapes:
        cache_seqlens: [B] int32, L_b: committed positions of the target cache
        roots: [B] int64, the last emitted token of each row (not yet in any cache)
        block_table: [B, max_blocks] int32, shared by the target and draft caches
        temperature: [B] float32 (0 = greedy)
        keys: [B] int64, the row's random stream for this step, a function of (request seed, L_b) only
        coupled: [B] bool, rows sampled through the position-keyed coupling (``spec_engine.coupling``), or None
            when no row is; noise_seeds: [B] int64, their noise seeds (None likewise)
    ``rows`` are the requests' read-only views; ``gammas`` the tree depth each row asks for (0 = no drafting);
    ``suffix_rows`` the rows a hybrid drafter serves with its suffix speculation this step (None: no such rows);
    ``width`` the step's tree width where the adaptive controller chooses it (``Drafter.tree_for``; 0: the drafter's
    own tree).
    """

    rows: list[RowView]
    cache_seqlens: torch.Tensor
    roots: torch.Tensor
    block_table: torch.Tensor
    temperature: torch.Tensor
    keys: torch.Tensor
    gammas: list[int]
    coupled: torch.Tensor | None = None
    noise_seeds: torch.Tensor | None = None
    suffix_rows: list[bool] | None = None
    width: int = 0

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def draft_temperature(self) -> torch.Tensor:
        """[B] the temperature each row's draft distribution q is taken at: the row's own, 1 on greedy rows (whose q
        verification never reads, so no division by 0)."""
        return torch.where(self.temperature == 0, 1.0, self.temperature)

    @property
    def free_draws(self) -> bool:
        """Some row draws from its own random stream (neither greedy nor coupled: host-known)."""
        return any(not (r.greedy or r.coupled) for r in self.rows)

    def select(self, rows: list[int], index: torch.Tensor) -> StepBatch:
        """The sub-batch of ``rows``; ``index`` is the same list as a tensor on the batch's device."""
        coupled = None if self.coupled is None else self.coupled[index]
        noise_seeds = None if self.noise_seeds is None else self.noise_seeds[index]
        suffix_rows = None if self.suffix_rows is None else [self.suffix_rows[b] for b in rows]
        return StepBatch([self.rows[b] for b in rows], self.cache_seqlens[index], self.roots[index],
                         self.block_table[index], self.temperature[index], self.keys[index],
                         [self.gammas[b] for b in rows], coupled, noise_seeds, suffix_rows, self.width)  # fmt: skip


@dataclass(frozen=True)
class DraftPlan:
    """What a drafter that ``plans`` will draft this step: ``gammas`` the depth per row (0: not drafted), and
    ``suffix_rows`` the rows drafted by suffix speculation (a hybrid's, or every drafted row of a suffix drafter;
    None: none), whose acceptance says nothing of the chains the adaptive controller prices (their passes still price
    the widths they verify). A drafter whose trees' sizes depend on what it finds (suffix speculation) also says, per
    row, ``nodes`` (T of its tree, 1 undrafted) and ``expected`` (the drafted tokens its tree is expected to keep), so
    the engine can price the step it shapes (every row padded to the widest tree) before running it; None: the
    adaptive controller's depths priced it."""

    gammas: list[int]
    suffix_rows: list[bool] | None = None
    nodes: list[int] | None = None
    expected: list[float] | None = None
    sure: list[bool] | None = None  # rows drafted a grammar's forced chain: their acceptance teaches no score trust

    def without(self, rows: set[int]) -> DraftPlan:
        """The plan with ``rows`` not drafted."""
        keep = [b not in rows for b in range(len(self.gammas))]

        def cut(values, off):
            return None if values is None else [v if k else off for v, k in zip(values, keep)]

        return DraftPlan(
            cut(self.gammas, 0),
            cut(self.suffix_rows, False),
            cut(self.nodes, 1),
            cut(self.expected, 0.0),
            cut(self.sure, False),
        )


@dataclass
class Draft:
    """One step's proposal. ``draft_probs`` is None for deterministic drafts (point-mass proposals).

    Shapes: tokens, parents [B, T] int64 (parents -1 for the root and padding); draft_probs [B, T, V];
    tree_mask [B, T, T] bool and depths [B, T] int64 (see ``spec_engine.tree.tree_mask_and_depths``): a drafter
    knows its tree's shape and hands them over, so the engine never derives them from device values.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    tree_mask: torch.Tensor
    depths: torch.Tensor
    draft_probs: torch.Tensor | None = None
    draft_sampling: str = "iid"


class Drafter(ABC):
    """Proposes trees. Drafters with a KV cache (``keeps_cache``) keep it in step with the target's through
    ``prefill``/``commit``."""

    max_gamma: int  # the deepest tree this drafter proposes
    max_nodes: int  # T for a row drafted at max_gamma
    keeps_cache: bool = False  # True: commit returns the new lengths of the drafter's own cache
    tree = None  # the StaticTree a tree drafter proposes (None: chains); the adaptive controller plans by depth
    # Drafters that read the target's features (EAGLE heads): ``prefill`` sees every prompt chunk (adaptive or not)
    # and ``commit`` every row of every step (drafted or not), both with the target's hidden states [B, T, F] of that
    # pass: its final ones (``target_layers`` None) or the residual streams entering ``target_layers``, concatenated.
    needs_hidden: bool = False
    target_layers: tuple[int, ...] | None = None
    plans: bool = False  # True: ``plan`` revises each step's depths (suffix drafters: no draft where nothing matches)
    # True: ``plan`` shapes every drafted row's tree itself from what it finds (suffix speculation: a row's depth is
    # its budget of nodes); the adaptive controller then offers every row the largest budget and learns no acceptance
    # from such rows
    sizes_trees: bool = False
    plain_chain_cap: int | None = None  # the longest plain native chain the engine may run between two plans
    kv: PagedKVCache | None = None  # the drafter's own KV cache, where it keeps one (``keeps_cache``)
    # the target's features by position [1, num_blocks, block_size, H] on the caches' blocks, where the drafter reads
    # them (``needs_hidden``): the engine's native speculative steps write it
    features: torch.Tensor | None = None
    graphs = None  # the CapturedForward its model's forwards replay from (``use_graphs``); None: eager
    # tree width -> the deepest depth at it, where the adaptive controller chooses each step's width (``tree="auto"``:
    # 1 a chain, k EAGLE-2's dynamic tree of k nodes a level); None: the drafter's own tree, every step
    widths: dict[int, int] | None = None

    def tree_for(self, width: int):
        """The StaticTree of a step of ``width`` (``StepBatch.width``, ``StepPlan.width``; 0: ``tree``)."""
        return self.tree

    def plan(self, rows: list[RowView], gammas: list[int], gains: list[float] | None = None,
             faster: Callable[[int, int, float], bool] | None = None) -> DraftPlan:  # fmt: skip
        """Revise the step's depths per row (``gammas``: the engine's or the adaptive controller's choice), before
        the step is shaped. ``gains`` [B]: the adaptive controller's expected accepted drafted tokens of the model
        drafter at each row's depth (None without the controller). ``faster(b, nodes, tokens)``, where the
        controller prices steps (batch 1): whether row b's step verifying ``nodes`` (its root included) and
        expected to emit ``tokens`` is faster, in tokens per second, than the step at the controller's depth."""
        return DraftPlan(gammas)

    def finish_request(self, row: RowView) -> None:  # noqa: B027
        """Request ``row.key`` is retired (``row``: its final tokens, the last step's included): drop what this
        drafter keeps for it alone."""

    def prefill(self, input_ids, positions, cache_seqlens, mask, block_table, hidden=None) -> None:  # noqa: B027
        """See the same prompt chunk the target prefilled. Shapes as ``LlamaForCausalLM.forward``; ``hidden``
        [B, T, F] for drafters that need the target's features, else None."""

    def store_features(self, positions, block_table, hidden) -> None:  # noqa: B027
        """A drafter that reads the target's features (``needs_hidden``) keeps a prompt chunk's ``hidden``
        [B, T, F] at ``positions`` [B, T] without running on it: under the adaptive controller its cache is fed by
        the catch-up of the first drafted step, which the controller prices (a row that never drafts never pays)."""

    @abstractmethod
    def propose(self, batch: StepBatch) -> Draft: ...

    def commit(self, batch: StepBatch, result: VerifyResult, num_accepted: list[int], hidden=None) -> list[int] | None:
        """Learn which path the target accepted: compact own caches; return each row's new cache length.

        ``num_accepted`` is ``result.num_accepted`` already read on the host (the step's one sync); ``hidden``
        [B, T, F] the target's features at every node, for drafters that need them."""
        return None

    def nodes_for_gamma(self, gamma: int, width: int = 0) -> int:
        """T of a tree of depth ``gamma`` at ``width`` (``tree_for``; a chain where the drafter has no tree), for KV
        reservations, cost models and the native calls."""
        tree = self.tree_for(width)
        return tree.nodes(gamma) if tree is not None else gamma + 1

    def use_graphs(self, enforce_eager: bool, mechanism: str | None = None, *, table_width: int,  # noqa: B027
                   max_rows: int) -> None:  # fmt: skip
        """Replay this drafter's forwards from graphs captured per bucket, as the target's pass
        (spec_engine/cuda_graphs.py; ``table_width``, ``max_rows``: the engine's block table), or run them eagerly
        (``enforce_eager``); drafters with no model forward to capture ignore it."""

    @property
    def native(self) -> NativeModel | NativeHead | None:
        """The draft model or EAGLE-3 head as the native speculative chains take it (``StepRunner._spec_chain``), when
        this drafter proposes greedy chains from it on its own cache ``kv``; else None."""
        return None


def propose_rows(drafter: Drafter, batch: StepBatch, rows: list[int], index: torch.Tensor | None) -> Draft:
    """The drafter's trees for ``rows`` (depth > 0), run on those rows only; every other row is its root alone.

    ``index`` is ``rows`` on the device (None unless only some rows are drafted)."""
    if rows and len(rows) == batch.size:
        return drafter.propose(batch)
    B, dev = batch.size, batch.roots.device
    if not rows:
        return Draft(batch.roots[:, None], torch.full((B, 1), PAD_NODE, dtype=torch.int64, device=dev),
                     torch.ones(B, 1, 1, dtype=torch.bool, device=dev),
                     torch.zeros(B, 1, dtype=torch.int64, device=dev))  # fmt: skip
    sub = drafter.propose(batch.select(rows, index))  # [B_d, T]
    T = sub.tokens.shape[1]
    tokens = sub.tokens.new_zeros(B, T)  # [B, T]
    tokens[:, 0] = batch.roots
    tokens[index] = sub.tokens
    parents = torch.full((B, T), PAD_NODE, dtype=torch.int64, device=dev)  # undrafted rows: all padding
    parents[index] = sub.parents
    mask = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T).clone()  # [B, T, T]: padding sees itself
    mask[index] = sub.tree_mask
    depths = torch.zeros(B, T, dtype=torch.int64, device=dev)
    depths[index] = sub.depths
    probs = None
    if sub.draft_probs is not None:
        probs = sub.draft_probs.new_zeros(B, T, sub.draft_probs.shape[-1])  # [B, T, V]
        probs[index] = sub.draft_probs
    return Draft(tokens, parents, mask, depths, probs, sub.draft_sampling)
