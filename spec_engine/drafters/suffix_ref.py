"""Suffix decoding's data structure in plain Python: the spec of ``csrc/suffix_tree_cpu.cpp`` (SuffixDecoding,
NeurIPS 2025; ArcticInference's ``suffix_decoding``).

Glossary:
    suffix tree      here a depth-bounded suffix trie over several token sequences: the node of a string s (at most
                     ``max_depth`` tokens) exists while s occurs in some sequence, and its ``count`` is the number of
                     occurrences of s (one per end position). Appending a token to a sequence extends the
                     ``max_depth`` suffixes that end at its last token: O(max_depth) per token.
    match            the node of the last ``match_len`` tokens of the context (the longest such suffix that occurs
                     is the longest match; every shorter one occurs too).
    probability      of a child c of node n: count(c) / count(n), the share of n's occurrences that went on with c
                     (an occurrence at a sequence's end goes on with nothing, so the shares sum to at most 1). A
                     drafted node's probability is the product along its path from the match: the estimated chance
                     that the target emits the whole path.
    speculation tree grown greedily from the match: the most probable node not yet drafted is drafted next, while
                     its probability is at least ``min_token_prob``, up to ``max_spec_factor * match_len`` nodes
                     (capped at ``max_tokens``). Its score is the sum of the drafted nodes' probabilities: the expected
                     number of drafted tokens the target accepts.
    best match       every match length from 1 up to the longest is tried; the speculation with the highest score
                     wins (ties: the longer match).

Ties are broken the same way everywhere, so the C++ tree and this one propose the same trees exactly: children by
count (descending), then the one whose count last grew first (a continuation seen lately is the likelier one; the
order ArcticInference keeps its siblings in); equal probabilities in the order their nodes were queued.
Probabilities are float64, computed as ``parent_prob * count(child) / count(node)`` in that order.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

SPEC_EPS = 1e-6  # added to max_spec_factor * match_len before it is truncated to a node budget (ArcticInference's)


@dataclass
class SuffixDraft:
    """One speculation: ``tokens[i]`` hangs under ``parents[i]`` (-1: under the context's last token, the root) with
    estimated probability ``probs[i]``; nodes come in the order they were drafted, so ``parents[i] < i``."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0  # sum of probs: expected accepted drafted tokens
    match_len: int = 0
    sure: bool = False  # tokens a grammar forces (RowView.forced), not a match: its score needs no trust


class _Node:
    __slots__ = ("count", "stamp", "children")

    def __init__(self):
        self.count = 0
        self.stamp = 0  # when its count last grew (the tree's clock): ties between siblings go to the latest
        self.children: dict[int, _Node] = {}

    def ranked_children(self) -> list[tuple[int, _Node]]:
        return sorted(self.children.items(), key=lambda kv: (-kv[1].count, -kv[1].stamp))


class SuffixTreeRef:
    """A depth-bounded suffix trie over sequences keyed by int ids (see the module docstring)."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[_Node]] = {}  # seq -> nodes of its suffixes of length 1, 2, ... (<= max_depth)
        self._clock = 0  # count increments so far

    def extend(self, seq_id: int, tokens) -> None:
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        for t in (int(x) for x in tokens):
            seq.append(t)
            new = []
            for node in [self.root, *active[: self.max_depth - 1]]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                self._clock += 1
                child.stamp = self._clock
                new.append(child)
            active[:] = new

    def remove(self, seq_id: int) -> None:
        """Forget a sequence (none: nothing): every occurrence it added is taken back, and nodes no sequence holds
        are freed."""
        seq = self._seqs.pop(seq_id, [])
        self._active.pop(seq_id, None)
        for start in range(len(seq)):
            node = self.root
            for t in seq[start : start + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:  # its subtree held only this occurrence's continuation: freed with it
                    del node.children[t]
                    break
                node = child

    def frequency(self, tokens) -> int:
        """Occurrences of the string ``tokens`` (1 to max_depth tokens) across the sequences."""
        node = self._match(list(tokens))
        return node.count if node is not None else 0

    def num_nodes(self) -> int:
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += len(node.children)
            stack.extend(node.children.values())
        return total

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def _match(self, tokens: list[int]) -> _Node | None:
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def speculate(self, context, max_tokens: int, max_spec_factor: float, min_token_prob: float,
                  tree: bool = True) -> SuffixDraft:  # fmt: skip
        """The best speculation over every match length (see the module docstring); ``tree=False`` drafts a chain:
        the most frequent child at each step."""
        context = [int(x) for x in context]
        best = SuffixDraft()
        for match_len in range(1, min(len(context), self.max_depth) + 1):
            node = self._match(context[len(context) - match_len :])
            if node is None:
                break
            budget = min(max_tokens, int(match_len * max_spec_factor + SPEC_EPS))
            draft = (self._grow_tree if tree else self._grow_chain)(node, max(budget, 0), min_token_prob)
            if draft.score >= best.score:
                draft.match_len = match_len
                best = draft
        return best

    @staticmethod
    def _grow_tree(node: _Node, budget: int, min_token_prob: float) -> SuffixDraft:
        out = SuffixDraft()
        queue: list[tuple[float, int, int, _Node, int]] = []  # (-prob, order queued, token, node, parent index)
        order = 0

        def push_children(parent: _Node, prob: float, index: int) -> None:
            nonlocal order
            for token, child in parent.ranked_children():
                p = prob * child.count / parent.count
                if p < min_token_prob:
                    break  # the rest are rarer
                heapq.heappush(queue, (-p, order, token, child, index))
                order += 1

        push_children(node, 1.0, -1)
        while queue and len(out.tokens) < budget:
            neg_p, _, token, child, parent_index = heapq.heappop(queue)
            out.tokens.append(token)
            out.parents.append(parent_index)
            out.probs.append(-neg_p)
            out.score += -neg_p
            push_children(child, -neg_p, len(out.tokens) - 1)
        return out

    @staticmethod
    def _grow_chain(node: _Node, budget: int, min_token_prob: float) -> SuffixDraft:
        out, prob = SuffixDraft(), 1.0
        while len(out.tokens) < budget and node.children:
            token, child = node.ranked_children()[0]
            prob = prob * child.count / node.count
            if prob < min_token_prob:
                break
            out.tokens.append(token)
            out.parents.append(len(out.tokens) - 2)
            out.probs.append(prob)
            out.score += prob
            node = child
        return out


class SuffixCache:
    """The per-request trees and the global tree of suffix decoding, fed from the requests' token histories.

    Each active request has its own tree over its prompt and output; the global tree holds the outputs of the last
    ``max_cached_requests`` requests (active ones included: a request's output joins it as it is emitted), evicting
    whole requests oldest first (0: no global tree; -1: unbounded). Each output is indexed behind its prompt's last
    ``max_depth - 1`` tokens (its *anchor*): a request served again then matches its answer at its first step, where
    an output alone is matched only by what the request already emitted, and its drafts grow from one token
    (``max_spec_factor`` nodes per matched token) over the first steps. A speculation takes whichever tree's best
    draft scores higher (ties: the request's own). ``make_tree(max_depth)`` builds a tree: ``SuffixTreeRef`` or the C++
    one (``spec_engine.drafters.suffix.native_tree``), which share this interface.
    """

    def __init__(self, max_depth: int, max_cached_requests: int, make_tree=SuffixTreeRef):
        self.max_depth, self.max_cached_requests, self.make_tree = max_depth, max_cached_requests, make_tree
        self.anchor = max_depth - 1  # the prompt's last tokens indexed before its output in the global tree
        self.global_tree = make_tree(max_depth) if max_cached_requests != 0 else None
        self._local: dict[int, object] = {}  # request key -> its tree
        self._indexed: dict[int, int] = {}  # request key -> tokens of its history already in its trees
        self._cached: OrderedDict[int, None] = OrderedDict()  # request keys whose output the global tree holds, FIFO

    @property
    def active_requests(self) -> list[int]:
        return list(self._local)

    @property
    def cached_requests(self) -> list[int]:
        return list(self._cached)

    def update(self, key: int, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        """Index the tokens of request ``key``'s history (prompt then output) not yet seen."""
        if key not in self._local:
            self._local[key] = self.make_tree(self.max_depth)
            self._indexed[key] = 0
            if self.global_tree is not None:
                self._cached[key] = None
                self._evict(keep=key)
        start = self._indexed[key]
        if start >= len(token_ids):
            return
        self._local[key].extend(0, token_ids[start:])
        self._index_globally(key, token_ids, start, num_prompt_tokens)
        self._indexed[key] = len(token_ids)

    def finish(self, key: int, token_ids: np.ndarray | None = None, num_prompt_tokens: int = 0) -> None:
        """Drop request ``key``'s own tree; its output stays in the global tree until evicted, with ``token_ids`` (its
        final history) the tokens its last step emitted too (no speculation after them indexed them)."""
        self._local.pop(key, None)
        start = self._indexed.pop(key, None)
        if token_ids is not None and start is not None:
            self._index_globally(key, token_ids, start, num_prompt_tokens)

    def _index_globally(self, key: int, token_ids: np.ndarray, start: int, num_prompt_tokens: int) -> None:
        """The global tree's share of ``token_ids[start:]``: the output and the anchor before it."""
        first = max(start, num_prompt_tokens - self.anchor, 0)
        if key in self._cached and first < len(token_ids):
            self.global_tree.extend(key, token_ids[first:])

    def speculate(self, key: int, context: np.ndarray, max_tokens: int, max_spec_factor: float,
                  min_token_prob: float, tree: bool = True) -> SuffixDraft:  # fmt: skip
        context = context[-self.max_depth :]
        best = self._local[key].speculate(context, max_tokens, max_spec_factor, min_token_prob, tree)
        if self.global_tree is not None:
            other = self.global_tree.speculate(context, max_tokens, max_spec_factor, min_token_prob, tree)
            if other.score > best.score:
                best = other
        return best

    def _evict(self, keep: int) -> None:
        if self.max_cached_requests < 0:
            return
        while len(self._cached) > self.max_cached_requests:
            oldest = next(k for k in self._cached if k != keep)
            del self._cached[oldest]
            self.global_tree.remove(oldest)
