"""Token-tree shapes: static trees from children-per-depth, masks and depths from ``parents``.

Glossary: node 0 is the root (the last emitted token); ``parents[b, i] < i`` for real nodes, ``PAD_NODE`` (-1) for
the root and for padding. A chain is the tree ``[1] * gamma``. A node's rank is its place among its siblings, 0 for
its parent's likeliest child: the node a chain of the same draft would have drafted there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_kernels import PAD_NODE

# the last entry of ``path_ranks``: how the accepted path ended (csrc/runner_cpu.h's kPathRejected, kPathLeaf)
PATH_REJECTED = -1  # at a node with children, all rejected
PATH_LEAF = -2  # at a node without children: nothing below it was judged


@dataclass(frozen=True)
class StaticTree:
    """A tree shape fixed for every step: ``branching[d]`` children for each node at depth d.

    Nodes are numbered breadth-first, so each depth is one contiguous range ``level_slices[d]``. ``topk`` k: EAGLE-2's
    dynamic tree, of the shape (k, 1, ..., 1): k nodes per level, whose parents the drafter chooses per row and step
    (``parents`` is then only the numbering); None: a static tree.
    """

    branching: tuple[int, ...]
    topk: int | None = None

    def __post_init__(self):
        if not self.branching or any(int(b) < 1 for b in self.branching):
            raise ValueError(f"tree branching must be a non-empty list of positive ints, got {list(self.branching)}")

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def is_chain(self) -> bool:
        return all(b == 1 for b in self.branching)

    @property
    def level_sizes(self) -> list[int]:
        sizes = [1]
        for b in self.branching:
            sizes.append(sizes[-1] * b)
        return sizes

    @property
    def num_nodes(self) -> int:
        return sum(self.level_sizes)

    @property
    def level_slices(self) -> list[slice]:
        out, start = [], 0
        for n in self.level_sizes:
            out.append(slice(start, start + n))
            start += n
        return out

    def nodes(self, gamma: int) -> int:
        """T of the tree cut at depth ``gamma``."""
        return sum(self.level_sizes[: gamma + 1])

    def native_shape(self, gamma: int) -> tuple[tuple[int, ...], int]:
        """The shape ``spec_chain`` takes at depth ``gamma``: (its ``tree``, the branching cut to gamma levels, empty
        for a static chain; its ``topk``, the dynamic tree's k, else 0)."""
        return (() if self.is_chain and not self.topk else self.branching[:gamma]), self.topk or 0

    def parents(self) -> torch.Tensor:
        """[T] int64, breadth-first: the children of level-d node j are consecutive."""
        parents = [PAD_NODE]
        for d, b in enumerate(self.branching):
            level = self.level_slices[d]
            parents.extend(p for p in range(level.start, level.stop) for _ in range(b))
        return torch.tensor(parents, dtype=torch.int64)


def chain(gamma: int) -> StaticTree:
    return StaticTree((1,) * gamma)


def dynamic_tree(topk: int, gamma: int) -> StaticTree:
    """EAGLE-2's dynamic tree of ``topk`` nodes a level, ``gamma`` levels deep: 1 + topk * gamma nodes."""
    return StaticTree((topk,) + (1,) * (gamma - 1), topk)


def path_ranks(parents: list[int], path: list[int]) -> list[int]:
    """The accepted path's ranks, the rule ``spec_chain`` applies natively (csrc/runner_cpu.h): ``parents`` [T] one
    row's tree (siblings numbered likeliest first: a static tree's children, a dynamic level's by score), ``path``
    [n] its accepted nodes from the root. Entry i < n - 1 is the rank of node path[i + 1]; entry n - 1 is
    ``PATH_REJECTED`` where the last node has children (all rejected), ``PATH_LEAF`` where it has none."""
    ranks = [sum(p == parents[node] for p in parents[1:node]) for node in path[1:]]
    last = path[-1]
    return [*ranks, PATH_REJECTED if last in parents[last + 1 :] else PATH_LEAF]


def tree_mask_and_depths(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T, T] bool, [B, T] int64): node i sees j when j is i or an ancestor of i; depth of each node.

    Every node climbs to the root at once, one level per iteration: depth + 1 iterations, not T. Padding
    (parent -1 past the root) sees only itself and has depth 0. It reads values once per level, so the engine runs
    it on host tensors only (tree shapes are host-known: see ``Draft``) and sends the result to the device.
    """
    B, T = parents.shape
    if bool((parents >= torch.arange(T, device=parents.device)).any()):  # a cycle would climb forever
        raise ValueError("tree parents must precede their nodes (parents[b, i] < i; -1 for the root and padding)")
    eye = torch.eye(T, dtype=torch.bool, device=parents.device)
    mask = eye.expand(B, T, T).clone()
    depth = torch.zeros(B, T, dtype=torch.int64, device=parents.device)
    up = parents.clone()  # [B, T]: each node's current ancestor, -1 once past the root
    while True:
        alive = up >= 0
        if not bool(alive.any()):
            return mask, depth
        mask |= eye[up.clamp(min=0)] & alive[..., None]
        depth += alive
        up = torch.where(alive, parents.gather(1, up.clamp(min=0)), -1)


def causal_mask(B: int, T: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, T, T] lower-triangular: a chunk of prompt tokens is a chain."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)
