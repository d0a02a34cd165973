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
Greedy rows always take the b most likely tokens: greedy verification ignores q. Coupled rows (seeded sampling,
``spec_engine/coupling.py``) take the top b of log q + the coupling's Gumbel noise at the parents' position: the
target's own perturbed choice wherever the two models agree. Random draws come from counter-based streams keyed by
(request seed, position): the same alone or in any batch, with no generator state.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from spec_engine.coupling import position_gumbel
from spec_engine.cuda_graphs import CapturedForward, captured_forward
from spec_engine.drafters.base import Draft, Drafter, StepBatch
from spec_engine.kv_cache import PagedKVCache
from spec_engine.models import LlamaForCausalLM
from spec_engine.transfer import to_device
from spec_engine.tree import StaticTree, causal_mask, tree_mask_and_depths
from spec_kernels import PAD_NODE, VerifyResult, compact_kv_, rng
from spec_kernels.decoder_layers import NativeHead, NativeModel

DRAFT_SAMPLING = ("without_replacement", "iid", "deterministic")
CATCH_UP_CHUNK = 128  # tokens per catch-up forward of a long-lagging row (see _catch_up)
CATCH_UP_SLACK = 8  # a row lagging more than this is caught up on its own, not padded into every row
MAX_SHAPES = 256  # tree shapes (one per pattern of row depths) kept on the device
# A draft directory's reduced vocabulary (FR-Spec): {"size": K, "token_ids": [...]}, ids most frequent first.
DRAFT_VOCAB_FILE = "draft_vocab.json"


def write_draft_vocab(tokens: torch.Tensor, vocab_size: int, out_dir: str | Path, size: int) -> Path:
    """Rank every token id by its count in ``tokens`` (a token stream of the draft's training text, any shape) and
    write ``out_dir/draft_vocab.json`` with ``size`` (K) as the default cut. Returns the file's path."""
    counts = torch.bincount(tokens.flatten().long(), minlength=vocab_size)[:vocab_size]  # [V]
    ranked = counts.argsort(descending=True, stable=True).tolist()  # ties: the lower id first
    path = Path(out_dir) / DRAFT_VOCAB_FILE
    path.write_text(json.dumps({"size": int(size), "token_ids": ranked}) + "\n")
    return path


def read_draft_vocab(draft_dir: str | Path, vocab_size: int, size: int | None) -> torch.Tensor | None:
    """The token ids ``[K]`` int64 (most frequent first) a draft restricts its logits to: the ``size`` most
    frequent of ``draft_vocab.json`` (``size`` None: the file's own default; no file: the full vocabulary). None
    for the full vocabulary. ValueError for a bad file or size."""
    path = Path(draft_dir) / DRAFT_VOCAB_FILE
    if size == vocab_size or (size is None and not path.is_file()):
        return None
    if not path.is_file():
        raise ValueError(f"draft_vocab_size={size} needs {path}: the draft's token ids, most frequent first "
                         "(spec_engine.drafters.draft_model.write_draft_vocab writes one)")  # fmt: skip
    try:
        spec = json.loads(path.read_text())
        ranked = [int(i) for i in spec["token_ids"]]
        size = spec["size"] if size is None else size
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size must be an int, got {size!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a draft vocabulary file ({e})") from None
    if not 1 <= size <= vocab_size or len(ranked) < min(size, vocab_size):
        raise ValueError(f"draft vocabulary size {size} must lie in [1, {vocab_size}] and {path} must rank at least "
                         f"that many ids (it ranks {len(ranked)})")  # fmt: skip
    if size == vocab_size:
        return None
    ids = torch.tensor(ranked[:size], dtype=torch.int64)
    if ids.unique().numel() != size or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{path}: token_ids must be distinct ids in [0, {vocab_size})")
    return ids


class DraftModelDrafter(Drafter):
    keeps_cache = True
    graphs: CapturedForward | None = None

    def __init__(self, model: LlamaForCausalLM, kv: PagedKVCache, tree: StaticTree,
                 draft_sampling: str = "without_replacement"):  # fmt: skip
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
        self.model, self.kv, self.tree, self.draft_sampling = model, kv, tree, draft_sampling
        self.device = kv.data.device
        self.max_gamma = tree.depth
        self.catch_up_chunk = CATCH_UP_CHUNK  # tokens per catch-up forward of a long-lagging row
        self.max_nodes = tree.num_nodes
        self._parents = tree.parents()  # [T_max] host
        node_depth = torch.cat([torch.full((n,), d) for d, n in enumerate(tree.level_sizes)])  # [T_max] host
        # Level d's forward runs nodes 1 .. end of level d re-rooted at node 1 (the root is cached at slot L_b):
        # their masks and depths, built once on the host and kept on the device.
        self._levels = []
        for level in tree.level_slices[1:-1]:
            sub = (self._parents[1 : level.stop] - 1).clamp(min=PAD_NODE)[None]  # [1, n]
            mask = tree_mask_and_depths(sub)[0]  # [1, n, n]
            self._levels.append(to_device(self.device, mask, node_depth[1 : level.stop]))
        self._shapes: dict[tuple, list[torch.Tensor]] = {}  # (gammas..., tree) -> its shapes

    @property
    def native(self) -> NativeModel | NativeHead | None:
        return self.model.native if self.tree.is_chain else None

    def use_graphs(self, enforce_eager: bool, mechanism: str | None = None, *, table_width: int,
                   max_rows: int) -> None:  # fmt: skip
        """The draft model's forwards up to a short catch-up's width or a tree's nodes (each level's, a catch-up's
        last) replayed from graphs per bucket, as the target's pass; prompt chunks and long catch-ups run eagerly."""
        width = max(CATCH_UP_SLACK + 1, self.max_nodes)
        self.graphs = None if enforce_eager else captured_forward(
            self._hidden, self.device, table_width=table_width, max_rows=max_rows, max_width=width,
            mechanism=mechanism, name="drafter's forward")  # fmt: skip

    def _hidden(self, tokens, positions, cache_seqlens, mask, block_table) -> tuple[torch.Tensor]:
        """The draft model's forward on its cache: (hidden states [B, T, H],), what ``graphs`` captures."""
        return (self.model(tokens, positions, self.kv.data, cache_seqlens, mask, block_table),)

    def prefill(self, input_ids, positions, cache_seqlens, mask, block_table, hidden=None) -> None:
        self._forward_prefix(input_ids, positions, cache_seqlens, mask, block_table)

    def _forward_prefix(self, tokens, positions, cache_seqlens, mask, block_table, last=None) -> torch.Tensor | None:
        """Tokens [B, T] of the sequences themselves (prompt, catch-up), a causal chunk at ``positions`` = cache_seqlens
        + t, their K/V written; with ``last`` [B] int64, the hidden states of those entries [B, H] (a prefill's and a
        long catch-up's chunks read none)."""
        hidden = (self.graphs or self._hidden)(tokens, positions, cache_seqlens, mask, block_table)[0]  # [B, T, H]
        return None if last is None else hidden[torch.arange(tokens.shape[0], device=self.device), last]

    def _forward_nodes(self, tokens, nodes, sub, positions, cache_seqlens, mask, block_table) -> torch.Tensor:
        """Tree nodes ``tokens[:, sub]``: their hidden states [B, n, H]. ``nodes`` [B, T, H] holds every node's
        hidden state computed so far (an EAGLE head reads its parents'; a draft model needs none)."""
        return (self.graphs or self._hidden)(tokens[:, sub], positions, cache_seqlens, mask, block_table)[0]

    def _tree_shape(self, gammas: list[int], tree: StaticTree | None = None) -> list[torch.Tensor]:
        """(parents [B, T], tree_mask [B, T, T], depths [B, T]) on the device for rows drafted at ``gammas``: the
        static tree (``tree``, else the drafter's own) cut at each row's depth (nodes past it are padding), built on
        the host once per pattern."""
        tree = tree or self.tree
        key = (*gammas, tree)
        if key not in self._shapes:
            T = tree.nodes(max(gammas))
            parents = tree.parents()[:T].repeat(len(gammas), 1)  # [B, T]
            for b, gamma in enumerate(gammas):
                parents[b, tree.nodes(gamma) :] = PAD_NODE
            mask, depths = tree_mask_and_depths(parents)
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
            self._shapes[key] = to_device(self.device, parents, mask, depths)
        return self._shapes[key]

    def _catch_up(self, batch: StepBatch) -> torch.Tensor:
        """Feed each row's tokens the draft cache lacks, then its root; return the root's hidden state [B, H]."""
        tokens, start, lags = self._catch_up_entries(batch)
        T = tokens.shape[1]
        positions = start.long()[:, None] + torch.arange(T, device=self.device)  # [B, T]
        return self._forward_prefix(tokens, positions, start, causal_mask(batch.size, T, self.device),
                                    batch.block_table, lags)  # fmt: skip

    def _catch_up_entries(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed each row's long lag; return the catch-up's last forward: tokens [B, T] (each row's few remaining
        tokens then its root, padded at the end), their first positions [B] int32 and the roots' indices [B] int64.

        A row that lags by more than ``CATCH_UP_SLACK`` tokens (its prompt, under the adaptive controller, or the
        tokens of a stretch it was left undrafted) is fed first, ``catch_up_chunk`` at a time and only on the rows
        that lag that much: no forward is wider than ``catch_up_chunk`` tokens, and the other rows are not padded
        to the longest lag. The last forward feeds every row its few remaining tokens and its root. Token ids and
        lengths come from the host views; only the block table rows are gathered on the device."""
        rows, dev = batch.rows, self.device
        cached = [r.draft_len for r in rows]  # this step's progress: the engine stores commit's lengths
        while True:
            long = [b for b, r in enumerate(rows) if r.cache_seqlen - cached[b] > CATCH_UP_SLACK]
            if not long:
                break
            counts = [min(rows[b].cache_seqlen - cached[b], self.catch_up_chunk) for b in long]
            n = max(counts)
            table = self.model.rope_table  # [2, P, D]: a padded slot's position stays inside it (ragged rows)
            if table is not None:
                n = min(n, min(table.shape[1] - cached[b] for b in long))
                counts = [min(c, n) for c in counts]
            tokens = np.zeros((len(long), n), dtype=np.int64)  # [n_long, n], ragged rows padded at the end
            for i, (b, count) in enumerate(zip(long, counts)):
                tokens[i, :count] = rows[b].token_ids[cached[b] : cached[b] + count]
            tokens, start, index = to_device(dev, torch.from_numpy(tokens),
                                             torch.tensor([cached[b] for b in long], dtype=torch.int32),
                                             torch.tensor(long, dtype=torch.int64))  # fmt: skip
            positions = start.long()[:, None] + torch.arange(n, device=dev)  # [n_long, n]
            self._forward_prefix(tokens, positions, start, causal_mask(len(long), n, dev), batch.block_table[index])
            for b, count in zip(long, counts):
                cached[b] += count
        lags = [r.cache_seqlen - c for r, c in zip(rows, cached)]
        tokens = np.zeros((batch.size, max(lags) + 1), dtype=np.int64)  # [B, T], padded at the end
        for b, (r, lag) in enumerate(zip(rows, lags)):
            tokens[b, : lag + 1] = r.token_ids[len(r.token_ids) - 1 - lag :]
        return to_device(dev, torch.from_numpy(tokens), torch.tensor(cached, dtype=torch.int32),
                         torch.tensor(lags, dtype=torch.int64))  # fmt: skip

    def propose(self, batch: StepBatch) -> Draft:
        gamma = max(batch.gammas)
        T = self.nodes_for_gamma(gamma)
        B, L, dev = batch.size, batch.cache_seqlens, self.device
        parents, tree_mask, depths = self._tree_shape(batch.gammas)
        levels = self.tree.level_slices
        all_greedy = all(r.greedy for r in batch.rows)  # host-known: no random draws at all
        greedy = None if all_greedy else batch.temperature == 0  # [B]
        temp = 1.0 if all_greedy else batch.draft_temperature[:, None, None]  # [B, 1, 1]
        tokens = torch.zeros(B, T, dtype=torch.int64, device=dev)  # [B, T]
        tokens[:, 0] = batch.roots
        root = self._catch_up(batch)  # [B, H]
        logits = self.model.logits(root)[:, None]  # [B, 1, V]: q logits of level 0
        if all_greedy and self.tree.is_chain and batch.coupled is None:
            # the whole chain in one native call: a level costs its weights, not a Python round of op dispatch
            chain = self.model.draft_chain(logits[:, 0], self.kv.data, L, gamma, batch.block_table)  # [B, gamma]
            if chain is not None:
                tokens[:, 1:] = chain
                return Draft(tokens, parents, tree_mask, depths, None, "iid")
        nodes = root.new_empty(B, T, root.shape[-1])  # [B, T, H]: each node's hidden state
        nodes[:, 0] = root
        # [B, T, V] draft distributions; an all-greedy batch needs none: its children are the top-b of the logits
        # (softmax keeps their order) and verify_tree ignores q on greedy rows (it then takes its one-call walk)
        q = None if all_greedy else torch.zeros(B, T, logits.shape[-1], device=dev)
        for d in range(1, gamma + 1):
            parent_level, level, b = levels[d - 1], levels[d], self.tree.branching[d - 1]
            q_parent = logits if q is None else torch.softmax(logits / temp, dim=-1)  # [B, n_parent, V]
            if q is not None:
                q[:, parent_level] = q_parent
            noise = None
            if batch.coupled is not None:  # the target's noise at the parents' position: L_b + d - 1
                noise = position_gumbel(batch.noise_seeds, L.long()[:, None] + (d - 1), q_parent.shape[-1])  # [B, 1, V]
            children = self._draw_children(
                q_parent, b, greedy, batch.keys + d, batch.coupled, noise, batch.free_draws
            )  # [B, n, b]
            tokens[:, level] = children.flatten(1)
            if d == gamma:
                break
            if self.tree.is_chain:  # a chain's earlier nodes are all ancestors: keep them as prefix, run one node
                sub, mask, sub_depths = slice(d, d + 1), torch.ones(B, 1, 1, dtype=torch.bool, device=dev), d
            else:  # levels 1..d, re-rooted at node 1
                sub, (mask, sub_depths) = slice(1, level.stop), self._levels[d - 1]
                mask = mask.expand(B, -1, -1)
            positions = L.long()[:, None] + sub_depths  # [B, n]
            hidden = self._forward_nodes(tokens, nodes, sub, positions, L + sub.start, mask, batch.block_table)
            nodes[:, sub] = hidden
            logits = self.model.logits(hidden[:, level.start - sub.start :])  # [B, n_level, V]: where it samples
        if self.draft_sampling == "deterministic" or q is None:
            return Draft(tokens, parents, tree_mask, depths, None, "iid")
        return Draft(tokens, parents, tree_mask, depths, q, self.draft_sampling)

    def _draw_children(
        self, q: torch.Tensor, b: int, greedy: torch.Tensor | None, keys: torch.Tensor,
        coupled: torch.Tensor | None = None, noise: torch.Tensor | None = None, free: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """[B, n, V] -> [B, n, b]: b children per node, in the order they were drawn, for every row at once.

        ``greedy`` [B] bool marks the greedy rows, None when every row is greedy. Random rows draw from
        counter-based streams (``spec_kernels.rng``) keyed per row and level: no generator objects, no per-row loop,
        and the same draws alone or in any batch. On the ``coupled`` [B] rows (None: no row is) the children are the
        top-b of log q + ``noise`` [B, 1, V], the coupling's Gumbel noise at the parents' position: the target's own
        perturbed choice whenever the two models agree. ``free`` (host-known): some random row draws from its own
        stream; when none does (every random row is coupled), those draws are not made (a V-wide hash per node)."""
        children = q.topk(b, dim=-1).indices  # greedy rows and "deterministic"
        if greedy is None or self.draft_sampling == "deterministic":
            return children
        B, n, V = q.shape
        log_q = q.log()  # [B, n, V]
        if not free and coupled is not None:
            draws = (log_q + noise).topk(b, dim=-1).indices
        elif self.draft_sampling == "iid":  # inverse CDF: b independent draws per node
            cdf = q.cumsum(-1)  # [B, n, V]
            u = rng.uniform(keys, (n, b)) * cdf[..., -1:]  # [B, n, b]
            draws = torch.searchsorted(cdf, u).clamp_(max=V - 1)
        else:  # Gumbel-top-b: exactly sequential sampling without replacement
            draws = (log_q + rng.gumbel(keys, (n, V))).topk(b, dim=-1).indices
        if coupled is not None and free:
            draws = torch.where(coupled[:, None, None], (log_q + noise).topk(b, dim=-1).indices, draws)
        return torch.where(greedy[:, None, None], children, draws)

    def commit(self, batch: StepBatch, result: VerifyResult, num_accepted: list[int], hidden=None) -> list[int]:
        compact_kv_(self.kv.planes, batch.cache_seqlens, result.accepted_nodes, result.num_accepted,
                    block_table=batch.block_table)  # fmt: skip
        # The deepest level drawn (max of the gammas) never ran through the draft model: a path that ends there
        # leaves the cache one token short, fed by the next step's catch-up.
        gamma = max(batch.gammas)
        return [r.cache_seqlen + n - (n - 1 >= gamma) for r, n in zip(batch.rows, num_accepted)]
