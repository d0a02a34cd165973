"""Seeded (coupled) sampled rows drafting EAGLE-2's dynamic trees: each level's children the Gumbel-top-k of the head's
logits perturbed with the coupling's noise at the parents' position, ranked by the path's cumulative log-softmax of
those (spec_engine/drafters/dynamic_tree.py), in the native steps (``spec_chain``) and the regular one:

- seeded output with dynamic trees (tree="auto", a forced width) is plain seeded sampling's, token for token, for the
  head and the hybrid, greedy and seeded rows in one batch, several seeds and temperatures, top-p 0.95 too, and the
  native steps ran the coupled rows' trees;
- the trees drafted natively are an independent reference's (each level the k best (parent, token) pairs of the
  whole level by cumulative perturbed log-softmax, in float64), node for node; a draft on the noise of the children's
  position instead of the parents' is caught;
- a tree's likeliest-first path (its rank-0 children) is the coupled chain the head drafts from the same state, so a
  tree step's ranks say what a chain would have kept (``tree_pricing.chain_evidence``);
- chi2: the first two tokens of many seeded requests drafted by dynamic trees in the native steps follow the target's
  exact joint; a planted walk that accepts a child equal to the target's unperturbed argmax (the token after the path
  still the coupled draw) is caught.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_eagle import P_BUG, P_MIN, N, V, small_eagle3  # noqa: F401 (small_eagle3: the fixture)
from test_engine_sampling import PROMPT, chi2_pvalue, exact_joint
from test_native_dynamic_tree import MAX_TOKENS, PROMPTS, _llm, _run, _same_drafts, pair  # noqa: F401 (pair)
from test_tree_width import _auto_llm, _fixed_width

import spec_engine.drafters.eagle as eagle_module
import spec_engine.runner as runner_module
from spec_engine import LLM, SamplingParams
from spec_engine.drafters.eagle import EagleDrafter
from spec_engine.engine import EngineConfig
from spec_engine.step import REGULAR, SPEC_CHAIN
from spec_kernels import VerifyResult, verify_tree
from spec_kernels.rng import position_gumbel


def _mixed(seed: int) -> list[SamplingParams]:
    """One greedy row beside two seeded ones (another temperature and top-p 0.95 on the second): one per prompt."""
    return [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.3, top_p=0.95, seed=seed + 7, ignore_eos=True),
    ]


@pytest.mark.parametrize("method", ["eagle", "hybrid"])
@pytest.mark.parametrize("steps", [16, 0])
def test_seeded_rows_on_dynamic_trees_emit_plain_samplings_tokens(pair, monkeypatch, method, steps):  # noqa: F811
    """tree="auto" (the controller's own widths) and width 3 forced, native calls or regular steps: every row's tokens
    are plain decoding's (the seeded ones plain seeded sampling's), and the native calls ran the coupled rows' trees
    (the forced hybrid's suffix side speculates nothing there: which side drafts a row is priced on the clock)."""
    from spec_engine.drafters.hybrid import HybridDrafter
    from spec_engine.drafters.suffix_ref import SuffixDraft

    native = []  # per seed: whether a native call ran the trees
    for seed in (1, 2, 3):
        params = _mixed(seed)
        plain = _run(LLM(pair[0], dtype="float32", max_model_len=128), params, monkeypatch)["tokens"]
        assert _run(_auto_llm(pair, method, steps), params, monkeypatch)["tokens"] == plain
        llm = _auto_llm(pair, method, steps)
        _fixed_width(llm, monkeypatch, 3)
        if method == "hybrid":
            monkeypatch.setattr(HybridDrafter, "_speculate", lambda self, row: SuffixDraft())
        out = _run(llm, params, monkeypatch)
        assert out["tokens"] == plain
        assert {p.width for p in out["plans"] if p.gamma or p.path == REGULAR} == {3}
        native.append(any(p.path == SPEC_CHAIN for p in out["plans"]))
        assert llm.engine.stats["num_accepted"] > 0
        monkeypatch.undo()
    assert native == [bool(steps)] * 3, "the native calls must have run the trees"


def reference_level(logits: torch.Tensor, parent_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """The rule, written apart from ``dynamic_level``: the level's k best (parent, token) pairs of all n * V by the
    parent's score plus the token's log-softmax, in float64, ties to the lower parent then the lower token. Shapes as
    ``dynamic_level``'s: logits [B, n, V] (a coupled row's perturbed), parent_scores [B, n]."""
    B, n, V = logits.shape
    z = logits.double()
    scores = parent_scores.double()[..., None] + torch.log_softmax(z, dim=-1)  # [B, n, V]
    scores = scores.masked_fill(scores.isnan(), float("-inf")).flatten(1)  # [B, n * V], parent-major: ties to the lower
    best, index = scores.sort(dim=-1, descending=True, stable=True)
    best, index = best[:, :k], index[:, :k]
    return best.float(), index // V, index % V


def test_native_coupled_trees_are_the_reference_rule(pair, monkeypatch):  # noqa: F811
    """Regular steps drafting natively (``eagle3_draft`` with topk and the coupled rows' noise) and the Python path
    with ``dynamic_level`` replaced by ``reference_level``: the same trees at every step (greedy and seeded rows
    together); a reference whose noise is the children's position's (L_b + d, a planted bug) is caught."""
    params = _mixed(3)
    native_drafts, reference_drafts, planted_drafts = [], [], []
    native = _run(_llm(pair, "float32", topk=3, steps=0), params, monkeypatch, native_drafts)
    monkeypatch.setattr(eagle_module, "dynamic_level", reference_level)
    reference = _run(_llm(pair, "float32", topk=3, steps=0), params, monkeypatch, reference_drafts, python=True)
    assert native["tokens"] == reference["tokens"] and len(native_drafts) > 10
    assert _same_drafts(native_drafts, reference_drafts)
    honest = EagleDrafter._chain_noise
    monkeypatch.setattr(EagleDrafter, "_chain_noise", lambda self, batch, gamma: honest(
        self, dataclasses.replace(batch, cache_seqlens=batch.cache_seqlens + 1), gamma))  # fmt: skip
    _run(_llm(pair, "float32", topk=3, steps=0), params, monkeypatch, planted_drafts, python=True)
    assert not _same_drafts(native_drafts, planted_drafts)


def test_a_trees_likeliest_path_is_the_coupled_chain(pair, monkeypatch):  # noqa: F811
    """At every regular step of width 3, the chain the head drafts from the same state (its coupled draws, at the
    step's depth) follows the tree's rank-0 children as far as the tree kept them: what ``chain_evidence`` reads a
    tree step's ranks as."""
    params = _mixed(4)
    llm = _auto_llm(pair, "eagle", 0)
    _fixed_width(llm, monkeypatch, 3)
    propose, compared = EagleDrafter.propose, []

    def both(self, batch):
        chain = propose(self, dataclasses.replace(batch, width=1))  # (rewrites the same catch-up entries)
        tree = propose(self, batch)
        for b in range(batch.size):
            node, tokens = 0, []
            parents = tree.parents[b].tolist()
            while kids := [i for i, p in enumerate(parents) if p == node]:
                node = kids[0]  # the likeliest child: the lowest index among its siblings
                tokens.append(int(tree.tokens[b, node]))
            compared.append((tokens, chain.tokens[b, 1 : 1 + len(tokens)].tolist(), batch.rows[b].greedy))
        return tree

    monkeypatch.setattr(EagleDrafter, "propose", both)
    _run(llm, params, monkeypatch)
    assert len(compared) > 20 and sum(not greedy for *_, greedy in compared) > 10
    assert all(tree == chain for tree, chain, _ in compared)


def _joint(small, temperature: float, steps: int) -> tuple[np.ndarray, LLM]:
    """Counts [V * V] of the first two tokens of N seeded requests drafted by dynamic trees of 2 a level, 2 deep, all
    admitted at once (4 tokens each, so native calls at depth 2 run them where ``steps``)."""
    target, head = small
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2, "tree": "dynamic", "eagle_topk": 2}
    llm = LLM(str(target), speculative_config=spec, max_model_len=32, max_num_seqs=N,
              engine_config=EngineConfig(spec_chain_steps=steps))  # fmt: skip
    params = [SamplingParams(max_tokens=4, temperature=temperature, seed=1000 + i, ignore_eos=True) for i in range(N)]
    counts = np.zeros(V * V)
    for o in llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False):
        a, b = o.outputs[0].token_ids[:2]
        counts[a * V + b] += 1
    return counts, llm


def _unperturbed_walk(logits, tokens, parents, *, temperature, noise_seeds, positions, coupled, **sampling):
    """The planted bug: ``verify_tree``'s coupled walk accepting a child equal to the target's unperturbed argmax
    (the greedy walk's path), the token after the path still the coupled draw at its end (argmax z / t + g)."""
    path = verify_tree(logits, tokens, parents, temperature=torch.zeros_like(temperature))
    out = torch.full_like(tokens, -1)
    for b in range(tokens.shape[0]):
        n = int(path.num_accepted[b])
        nodes = path.accepted_nodes[b, :n]
        end = int(nodes[-1])
        g = position_gumbel(noise_seeds[b : b + 1], positions[b : b + 1, end : end + 1], logits.shape[-1])[0, 0]
        out[b, : n - 1] = tokens[b, nodes[1:]]
        out[b, n - 1] = int((logits[b, end] / temperature[b] + g).argmax())
    return VerifyResult(path.accepted_nodes, out, path.num_accepted)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_coupled_dynamic_trees_are_lossless(small_eagle3, monkeypatch, temperature):  # noqa: F811
    """Native calls drafting coupled rows' dynamic trees keep the target's exact joint of the first two tokens
    (chi2); the planted walk on the unperturbed argmax (regular steps, where the walk is Python's) is caught."""
    counts, llm = _joint(small_eagle3, temperature, 16)
    stats = llm.engine.stats
    assert stats["num_accepted"] > N // 10, "the trees must be accepted often for this test to bite"
    assert stats["num_regular_steps"] <= 2, "the native steps must have run the rows"
    exact = exact_joint(small_eagle3[0], temperature, 1.0)
    assert chi2_pvalue(counts, exact) > P_MIN
    monkeypatch.setattr(runner_module, "verify_tree", _unperturbed_walk)
    counts, _ = _joint(small_eagle3, temperature, 0)
    assert chi2_pvalue(counts, exact) < P_BUG
