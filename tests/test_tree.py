"""Tree shapes: static trees, ancestor masks and depths against a brute-force walk."""

from __future__ import annotations

import pytest
import torch

from spec_engine.tree import StaticTree, causal_mask, chain, tree_mask_and_depths


def brute(parents: list[int]) -> tuple[list[set[int]], list[int]]:
    seen, depths = [], []
    for i in range(len(parents)):
        anc, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            anc.add(j)
        seen.append(anc)
        depths.append(len(anc) - 1)
    return seen, depths


@pytest.mark.parametrize("branching", [(1,), (1, 1, 1, 1), (3, 2, 1), (2, 2, 2), (4,)])
def test_static_tree_shape(branching):
    tree = StaticTree(branching)
    parents = tree.parents()
    assert parents.shape == (tree.num_nodes,)
    assert all(parents[i] < i for i in range(1, len(parents)))
    _, depths = brute(parents.tolist())
    for d, level in enumerate(tree.level_slices):
        assert all(depths[i] == d for i in range(level.start, level.stop))


def test_mask_and_depths_match_brute_force_with_padding():
    g = torch.Generator().manual_seed(0)
    B, T = 5, 17
    parents = torch.full((B, T), -1)
    for b in range(B):
        for i in range(1, T):
            if torch.rand((), generator=g) < 0.8:  # else a padding node
                parents[b, i] = int(torch.randint(0, i, (), generator=g))
    mask, depth = tree_mask_and_depths(parents)
    for b in range(B):
        seen, depths = brute(parents[b].tolist())
        for i in range(T):
            assert set(mask[b, i].nonzero().flatten().tolist()) == seen[i]
        assert depth[b].tolist() == depths


def test_chain_is_causal():
    mask, depth = tree_mask_and_depths(chain(5).parents()[None])
    assert torch.equal(mask, causal_mask(1, 6))
    assert depth[0].tolist() == list(range(6))


def test_bad_branching():
    with pytest.raises(ValueError, match="positive"):
        StaticTree((2, 0))
    with pytest.raises(ValueError, match="positive"):
        StaticTree(())


@pytest.mark.parametrize("parents", [[-1, 2, 1], [-1, 1], [0, -1], [-1, 0, 5]], ids=["cycle", "self", "root", "past"])
def test_parents_that_do_not_precede_their_nodes_raise(parents):
    """A drafter's bad tree (a cycle would climb forever; a parent past the tree indexes out of it) is a clear error,
    not a hang."""
    with pytest.raises(ValueError, match="precede"):
        tree_mask_and_depths(torch.tensor([parents]))


def test_degenerate_trees():
    """No rows, a lone root, and an all-padding row."""
    mask, depth = tree_mask_and_depths(torch.full((0, 3), -1))
    assert mask.shape == (0, 3, 3) and depth.shape == (0, 3)
    mask, depth = tree_mask_and_depths(torch.full((2, 1), -1))
    assert mask.all() and not depth.any()
    mask, depth = tree_mask_and_depths(torch.full((1, 4), -1))
    assert torch.equal(mask[0], torch.eye(4, dtype=torch.bool)) and not depth.any()
