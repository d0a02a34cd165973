"""The one place a parsed speculative config becomes a drafter (``LLM`` calls it; nothing else builds drafters).

Building happens in the order the engine's memory plan needs it: the drafter's weights are loaded and checked
against the target first; then its tree fixes the node budget of a step (KV reservations); its caches' configs
and dtypes join the target's in the block plan; and only then is the drafter built on the engine's blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_engine.drafters.base import Drafter
from spec_engine.drafters.draft_model import DraftModelDrafter, read_draft_vocab
from spec_engine.drafters.eagle import EagleDrafter
from spec_engine.drafters.eagle_checkpoint import load_eagle_head
from spec_engine.drafters.hybrid import HybridDrafter
from spec_engine.drafters.ngram import NGRAM_MAX_N, NgramDrafter
from spec_engine.drafters.suffix import SuffixDrafter
from spec_engine.kv_cache import PagedKVCache
from spec_engine.models import ModelConfig, load_model
from spec_engine.models.gguf_tokenizer import token_texts
from spec_engine.tree import StaticTree, chain
from spec_engine.zoo.pull import resolve_model

DEFAULT_EAGLE_TOPK = 4  # nodes per level of EAGLE-2's dynamic tree (tree="dynamic")
AUTO_EAGLE_TOPK = 3  # ... of tree="auto"'s dynamic trees (bench/RESULTS.md, "Dynamic trees against chains")


class DrafterFactory:
    """What a parsed speculative config (``spec_engine.config.parse_speculative_config``; None: no drafter)
    builds for ``target``.

    After construction (weights loaded and checked): ``gamma`` the depth (the adaptive controller's deepest),
    ``tree`` a model drafter's tree (None for the model-free ones), ``max_tree_nodes`` the most nodes a row's step
    verifies, ``caches`` the (config, dtype) of each KV cache the drafter keeps. ``fuse`` prepares its model's lean
    path; ``build`` makes the drafter on the engine's blocks.
    """

    def __init__(self, spec: dict | None, target, target_dir: Path, *, dtype: torch.dtype, draft_dtype: torch.dtype,
                 device: str):  # fmt: skip
        self.spec, self.dtype, self.device = spec, dtype, device
        method = spec["method"] if spec else None
        model_method = spec["model_method"] if spec else None
        self.gamma = spec["num_speculative_tokens"] if spec else 0
        self.draft_model = self.head = None
        self.draft_dtype = draft_dtype
        if model_method == "eagle":
            self.head = load_eagle_head(spec["model"], target, dtype=dtype, device=device)
        if model_method == "draft_model":
            self.draft_model = _load_draft_model(spec, target.config, target_dir, draft_dtype, device)
        self.tree = None
        self.widths = spec.get("widths") if spec else None  # tree="auto": the widths the controller picks from
        if model_method is not None:
            # EAGLE-2's dynamic tree has a fixed shape, k nodes per level, whose parents the drafter picks each step
            dynamic = spec.get("tree") == "dynamic"
            static = spec.get("tree") if isinstance(spec.get("tree"), (list, tuple)) else ()  # ("auto": a chain)
            branching = (spec.get("eagle_topk", DEFAULT_EAGLE_TOPK),) if dynamic else tuple(static)
            topk = branching[0] if dynamic else None
            self.tree = (
                StaticTree(branching + (1,) * (self.gamma - len(branching)), topk) if branching else chain(self.gamma)
            )
            widest = max(self.tree.branching) if self.widths is None else max(self.widths)
            if self.head is not None and (not dynamic or self.widths) and widest > self.head.draft_vocab_size:
                # as a draft model's reduced vocabulary (_load_draft_model): b children drawn without replacement
                # need b ids with q > 0, or some are drawn with q = 0 and verified as if q proposed them
                raise ValueError(f"the EAGLE head's draft vocabulary of {self.head.draft_vocab_size} ids is narrower "
                                 f"than the tree's widest level ({widest} children)")  # fmt: skip
        self.max_tree_nodes = self.tree.num_nodes if self.tree else self.gamma + 1
        if self.widths:  # tree="auto": its widest is the dynamic tree
            self.max_tree_nodes = max(self.max_tree_nodes, 1 + max(self.widths) * self.gamma)
        if method == "hybrid":  # a suffix row's tree may be wider than the model's
            self.max_tree_nodes = max(self.max_tree_nodes, spec["suffix"]["suffix_decoding_max_spec_tokens"] + 1)
        self.caches: list[tuple[ModelConfig, torch.dtype]] = []
        if self.draft_model is not None:
            self.caches.append((self.draft_model.config, draft_dtype))
        if self.head is not None:
            self.caches.append((self.head.config, dtype))

    def fuse(self, max_positions: int) -> None:
        for m in (self.draft_model, self.head):
            if m is not None:
                m.fuse(max_positions=max_positions)

    def build(self, num_blocks: int, block_size: int) -> Drafter | None:
        """The drafter, its caches (if any) on the engine's ``num_blocks`` blocks of ``block_size`` tokens."""
        spec, device = self.spec, self.device
        if spec is None:
            return None
        sampling = spec.get("draft_sampling", "without_replacement")
        if self.head is not None:  # its KV cache and the target's features, on the target's block table
            head_kv = PagedKVCache(self.head.config, num_blocks, block_size, self.dtype, device)
            features = torch.zeros(1, num_blocks, block_size, self.head.config.hidden_size, dtype=self.dtype,
                                   device=device)  # fmt: skip
            drafter = EagleDrafter(self.head, head_kv, features, self.tree, sampling, self.widths)
        elif self.draft_model is not None:
            draft_kv = PagedKVCache(self.draft_model.config, num_blocks, block_size, self.draft_dtype, device)
            drafter = DraftModelDrafter(self.draft_model, draft_kv, self.tree, sampling)
        elif spec["method"] == "suffix":
            return suffix_drafter(spec, self.gamma, device)
        else:
            return NgramDrafter(self.gamma, spec.get("max_n", NGRAM_MAX_N), spec.get("min_n", 1), device=device)
        if spec["method"] == "hybrid":
            suffix = suffix_drafter(spec, spec["suffix"]["suffix_decoding_max_spec_tokens"], device)
            return HybridDrafter(drafter, suffix)
        return drafter


def suffix_drafter(spec: dict, max_tokens: int, device: str) -> SuffixDrafter:
    s = spec["suffix"]
    return SuffixDrafter(max_tokens, max_tree_depth=s["suffix_decoding_max_tree_depth"],
                         max_spec_factor=float(s["suffix_decoding_max_spec_factor"]),
                         min_token_prob=float(s["suffix_decoding_min_token_prob"]),
                         max_cached_requests=s["suffix_decoding_max_cached_requests"],
                         tree=s["suffix_decoding_use_tree_spec"], min_score=float(s["suffix_decoding_min_score"]),
                         device=device)  # fmt: skip


def _load_draft_model(spec: dict, target_cfg: ModelConfig, target_dir: Path, dtype: torch.dtype, device: str):
    """The draft model, checked against the target (vocabulary, tokenizer) and restricted to its draft vocabulary
    where it has one."""
    draft_model = load_model(resolve_model(spec["model"]), dtype=dtype, device=device)
    if draft_model.config.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"draft vocab ({draft_model.config.vocab_size}) != target vocab ({target_cfg.vocab_size}): "
                         "the draft model must share the target's tokenizer")  # fmt: skip
    _check_same_tokens(resolve_model(spec["model"]), target_dir)
    ids = read_draft_vocab(spec["model"], target_cfg.vocab_size, spec.get("draft_vocab_size"))
    widest = max(spec.get("tree") or [1]) if isinstance(spec.get("tree"), (list, tuple)) else 1
    if ids is not None and len(ids) < widest:  # b children drawn without replacement need b ids with q > 0
        raise ValueError(f"draft vocabulary of {len(ids)} ids is narrower than the tree's widest level ({widest} "
                         "children): drafts outside it would be verified as if q proposed them")  # fmt: skip
    if ids is not None:
        draft_model.restrict_vocab(ids)
    return draft_model


def _check_same_tokens(draft: str | Path, target: str | Path) -> None:
    """ValueError where the draft's token ids name other texts than the target's (GGUF files and HF directories
    alike; a tokenizer one of them lacks is not checked): such a draft proposes ids that mean something else to the
    target, lossless but nearly never accepted. Ids only one of them has (a vocabulary padded further) are not
    compared."""
    d, t = token_texts(draft), token_texts(target)
    if d is None or t is None:
        return
    diff = next((i for i, (a, b) in enumerate(zip(d, t)) if a != b), None)
    if diff is not None:
        raise ValueError(f"the draft's tokenizer ({draft}) differs from the target's ({target}): token {diff} is "
                         f"{d[diff]!r} in the draft, {t[diff]!r} in the target; a draft model must share the "
                         "target's tokenizer")  # fmt: skip
