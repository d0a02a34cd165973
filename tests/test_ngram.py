"""Tests of the n-gram (prompt lookup) drafter: ``ngram_lookup``'s edge cases and ``NgramDrafter``'s trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_engine.drafters.base import RowView, StepBatch
from spec_engine.drafters.ngram import NgramDrafter, ngram_lookup
from spec_kernels import PAD_NODE


def lookup(tokens: list[int], max_n: int = 4, min_n: int = 1, k: int = 4) -> list[int]:
    return ngram_lookup(np.array(tokens, dtype=np.int64), max_n, min_n, k).tolist()


# --- ngram_lookup ---------------------------------------------------------------------------------------------


def test_continues_the_most_recent_match():
    assert lookup([1, 2, 9, 1, 2, 8, 1, 2]) == [8, 1, 2]  # the later "1 2" was followed by 8, not the first's 9


def test_prefers_the_longest_suffix():
    # "3" alone last occurred before 7; "2 3" last occurred before 5: the longer n-gram wins
    assert lookup([2, 3, 5, 6, 3, 7, 2, 3], max_n=2) == [5, 6, 3, 7]
    assert lookup([2, 3, 5, 6, 3, 7, 2, 3], max_n=1) == [7, 2, 3]


def test_k_caps_the_continuation_and_the_history_end_cuts_it():
    assert lookup([4, 5, 6, 7, 8, 4], k=2) == [5, 6]
    assert lookup([4, 5, 4], k=4) == [5, 4]  # what follows the match runs into the suffix itself: two tokens


@pytest.mark.parametrize("tokens", [[], [7], [1, 2, 3, 4]])
def test_no_match_is_empty(tokens):
    assert lookup(tokens) == []


def test_min_n_rejects_short_matches():
    tokens = [9, 3, 5, 8, 3]  # only the 1-gram "3" recurs
    assert lookup(tokens, min_n=1) == [5, 8, 3]
    assert lookup(tokens, min_n=2) == []


def test_the_suffix_never_matches_itself():
    assert lookup([5, 5]) == [5]  # the earlier 5 matches, followed by the last
    assert lookup([6, 1, 6, 1], max_n=3) == [6, 1]  # "6 1" at 0 (the suffix's own start, 2, is excluded)


def test_the_history_is_not_copied_or_written():
    history = np.array([1, 2, 3, 1, 2], dtype=np.int64)
    history.flags.writeable = False  # as the engine hands it over
    out = ngram_lookup(history, 4, 1, 2)
    assert out.tolist() == [3, 1] and np.shares_memory(out, history)


# --- NgramDrafter ---------------------------------------------------------------------------------------------


def batch(rows: list[list[int]], gammas: list[int]) -> StepBatch:
    B = len(rows)
    views = [RowView(np.array(r, dtype=np.int64), len(r) - 1, 0, True) for r in rows]
    roots = torch.tensor([r[-1] for r in rows])  # [B]
    return StepBatch(views, torch.tensor([len(r) - 1 for r in rows], dtype=torch.int32), roots,
                     torch.zeros(B, 1, dtype=torch.int32), torch.zeros(B), torch.zeros(B, dtype=torch.int64),
                     gammas)  # fmt: skip


def test_drafter_pads_chains_to_the_deepest_row():
    rows = [[1, 2, 3, 1, 2], [4, 5, 6], [7, 8, 7, 8, 7], [9, 9, 9, 9]]
    draft = NgramDrafter(num_speculative_tokens=3).propose(batch(rows, [3, 3, 0, 2]))
    assert draft.tokens.shape == draft.parents.shape == draft.depths.shape == (4, 4)  # [B, T = max gamma + 1]
    assert draft.tree_mask.shape == (4, 4, 4) and draft.draft_probs is None
    assert draft.tokens[:, 0].tolist() == [2, 6, 7, 9]  # the roots
    assert draft.tokens[0, 1:].tolist() == [3, 1, 2] and draft.parents[0].tolist() == [PAD_NODE, 0, 1, 2]
    assert draft.parents[1].tolist() == [PAD_NODE] * 4  # no match: the root alone
    assert draft.parents[2].tolist() == [PAD_NODE] * 4  # gamma 0: not drafted, though a match exists
    # the longest suffix (9 9 9) matched just before the end: one token follows it, and a shorter n-gram's longer
    # continuation is not tried
    assert draft.tokens[3, 1] == 9 and draft.parents[3].tolist() == [PAD_NODE, 0, PAD_NODE, PAD_NODE]
    assert draft.depths[0].tolist() == [0, 1, 2, 3]
    assert draft.tree_mask[0].tolist() == torch.ones(4, 4).tril().bool().tolist()  # a chain sees its ancestors
    assert draft.tree_mask[1].tolist() == torch.eye(4).bool().tolist()  # padding sees only itself


def test_drafter_output_is_int64_on_its_device():
    draft = NgramDrafter(2, device="cpu").propose(batch([[1, 2, 1]], [2]))
    assert draft.tokens.dtype == draft.parents.dtype == torch.int64
    assert draft.tokens.device.type == "cpu" and draft.tokens.shape == (1, 3)
