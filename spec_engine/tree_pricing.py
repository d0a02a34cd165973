"""The pricing of tree shapes for the adaptive controller (spec_engine/adaptive.py): what a step of a given width and
depth is expected to emit and to verify, what a tree step says of the chain its draft would have drafted, and the cut
of a plan whose trees the drafter sized itself (``priced_plan``).

Glossary:
    width k     the step's tree width under ``speculative_config["tree"] = "auto"``: 1 a chain, k > 1 EAGLE-2's
                dynamic tree of k nodes a level (1 + k * gamma nodes at depth gamma)
    rank        a drafted node's place among its siblings, 0 for its parent's likeliest child (spec_engine/tree.py; a
                coupled row's by its perturbed logits: the coupled chain's draft, spec_engine/drafters/dynamic_tree.py)
    alpha       a row's chain acceptance: the chance that the likeliest child of the path's node is the target's token
    h_k         the rescue rate of width k: the chance that the level keeps the target's token though the likeliest
                child is not it (another of the k candidates is, where the tree kept the path's node's other children)
    beta        a k-wide level's acceptance, alpha + (1 - alpha) * h_k: a dynamic tree of depth gamma then emits the
                chain formula's tokens at beta, E = 1 + beta + ... + beta^gamma

Width choice: the controller keeps each row's chain alpha whatever width ran (a tree step's evidence is the count a
chain would have kept: in a dynamic tree a parent's likeliest child is kept whenever any of its children is, so a
chain's accepted tokens are the accepted path's prefix of rank-0 nodes), learns h_k pooled over rows from the tree
steps (``RescueRate``), prices each width's steps at its own verify width and draft work, and takes the (width,
depth) of the best expected tokens per second. A flat r(T) (a verify of a few more tokens costing about one) makes
the k - 1 extra candidates a level nearly free, and trees win; a steep one makes them dear, and chains win.
"""

from __future__ import annotations

from collections.abc import Callable

from spec_engine.drafters.base import DraftPlan
from spec_engine.estimates import TOKENS_REF, LinearCost
from spec_engine.tree import PATH_REJECTED, dynamic_tree

RESCUE_PRIOR = 0.3  # h before any tree step: about what a top-4 dynamic tree rescued on the shipped head
RESCUE_PRIOR_STRENGTH = 4.0  # ... worth this many missed likeliest children
RESCUE_DECAY = 0.995  # per judged level: the pooled rate remembers ~200 of them (a few dozen tree steps)


def shape_tables(width: int, max_gamma: int, nodes_for_gamma: Callable[[int], int],
                 tree: bool) -> tuple[list[int], list[float]]:  # fmt: skip
    """([D+1] T of a row drafted at depth gamma, [D+1] tokens per row of the draft's forwards at depth gamma) for a
    step of ``width``: the drafter's own trees (``nodes_for_gamma``, a tree where ``tree``) at width 1 when it offers
    no other, else width 1's chains and width k's dynamic trees. The draft's forwards run the root, then (trees) the
    nodes of each level above the deepest, re-rooted (a chain runs one new node per forward)."""
    nodes = [nodes_for_gamma(gamma) if width == 0 else dynamic_tree(max(width, 1), max(gamma, 1)).nodes(gamma)
             for gamma in range(max_gamma + 1)]  # fmt: skip
    wide = tree if width == 0 else width > 1
    draft_tokens = [0.0]
    for gamma in range(max_gamma):
        draft_tokens.append(draft_tokens[-1] + (max(nodes[gamma] - 1, 1) if wide else 1))
    return nodes, draft_tokens


def scan_depths(E: list[list[float]], plain_rate: float, nodes: list[int], draft_tokens: list[float],
                target_time: Callable[[int], float], draft_cost: LinearCost) -> tuple[int, int, float]:  # fmt: skip
    """The (G, k) with the best predicted tokens/s and that rate, G up to len(nodes) - 1 and k the rows drafted (the
    k that gain most); (0, 0, plain_rate) if none beats ``plain_rate``. E ``[B][D+1]`` each row's expected tokens per
    depth, ``nodes`` and ``draft_tokens`` the width's ``shape_tables``, ``target_time(width)`` a target pass's
    seconds, ``draft_cost`` the draft part's fit (c * G + d * tokens / TOKENS_REF)."""
    B, D = len(E), len(nodes) - 1
    best_rate, best_G, best_k = plain_rate, 0, 0
    cheapest = target_time(B * nodes[1]) + draft_cost.predict(1.0, 0.0)
    if (B + sum(row[D] - 1.0 for row in E)) / max(cheapest, 1e-9) <= best_rate:
        return 0, 0, plain_rate  # not even every row at full depth for the cost of depth 1 beats plain decoding
    for G in range(1, D + 1):
        t_fixed = target_time(B * nodes[G]) + draft_cost.predict(G, 0.0)
        t_per_row = draft_cost.predict(0.0, draft_tokens[G] / TOKENS_REF)
        gain = float(B)
        for k, e in enumerate(sorted((row[G] - 1.0 for row in E), reverse=True), start=1):  # best rows first
            gain += e
            rate = gain / max(t_fixed + k * t_per_row, 1e-9)
            if rate > best_rate:
                best_rate, best_G, best_k = rate, G, k
    return best_G, best_k, best_rate


def chain_evidence(ranks: list[int]) -> tuple[int, int]:
    """(the drafted tokens a chain of the step's depth would have kept, the depth it would have been judged to) from
    a step's accepted path's ranks (``spec_engine.tree.path_ranks``). The chain keeps the path's prefix of rank-0
    nodes; it is rejected one level on where the path went on through a lesser sibling or ended at a node whose
    children were all rejected, and judged no further where the path ended at a leaf (the depth, or a node the
    dynamic tree kept no child of: what the chain's next token would have met is unknown)."""
    kept = next((i for i, r in enumerate(ranks[:-1]) if r != 0), len(ranks) - 1)
    return kept, kept + (kept < len(ranks) - 1 or ranks[-1] == PATH_REJECTED)


class RescueRate:
    """h_k pooled over rows (see the glossary): forgetful counts of the levels whose likeliest child missed, and of
    those a lesser sibling rescued, with a prior of ``RESCUE_PRIOR``."""

    def __init__(self):
        self.rescued = self.missed = 0.0

    @property
    def rate(self) -> float:
        prior = RESCUE_PRIOR_STRENGTH * RESCUE_PRIOR
        return (self.rescued + prior) / (self.rescued + self.missed + RESCUE_PRIOR_STRENGTH)

    def observe(self, ranks: list[int], gamma: int) -> None:
        """One tree step's path ranks at depth ``gamma``: each lesser sibling on the path is a rescue; the path's end,
        where it stopped short of the depth, a miss (a node without kept children included: the tree failed there)."""
        for r in ranks[:-1]:
            if r > 0:
                self.rescued, self.missed = RESCUE_DECAY * self.rescued + 1.0, RESCUE_DECAY * self.missed
        if len(ranks) - 1 < gamma:
            self.rescued, self.missed = RESCUE_DECAY * self.rescued, RESCUE_DECAY * self.missed + 1.0


def priced_plan(plan: DraftPlan, pays: Callable[[int, float], bool]) -> DraftPlan:
    """A plan whose trees the drafter sized (``DraftPlan.nodes``), cut until its step pays: the step runs every row
    padded to the widest tree (B * T tokens), so the widest rows go undrafted (the least promising first among
    equals) until ``pays(B * T, tokens expected)`` holds or no row is drafted."""
    B, dropped = len(plan.gammas), set()
    drafted = {b for b, gamma in enumerate(plan.gammas) if gamma}
    while drafted - dropped:
        rows = drafted - dropped
        T = max(plan.nodes[b] for b in rows)
        if pays(B * T, B + sum(plan.expected[b] for b in rows)):
            break
        dropped.add(max(rows, key=lambda b: (plan.nodes[b], -plan.expected[b])))
    return plan.without(dropped) if dropped else plan
