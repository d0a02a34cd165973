"""The tree width chosen per step (``speculative_config["tree"] = "auto"``, spec_engine/tree_pricing.py, issue 66):

- with modelled costs (never the wall clock), the same acceptance statistics: a flat r(T) makes the adaptive
  controller take EAGLE-2's dynamic trees, a steep one chains; a planted bug (trees priced at a chain's verify width)
  is caught;
- the count a chain would have kept, from a tree step's accepted path (``path_ranks``, ``chain_evidence``), on trees
  built by hand, the path leaving the likeliest child included; the native steps' ranks equal the Python rule's on
  the regular step's trees;
- greedy output with the width chosen per step is plain decoding's (EAGLE and the hybrid, native calls and regular
  steps);
- an EAGLE head on a CPU takes "auto" by default ("chain": the chains);
- bad settings raise clear errors.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from test_native_dynamic_tree import MAX_TOKENS, _run, pair  # noqa: F401 (pair: the fixture)

import spec_engine.tree_pricing as tree_pricing
from bench.replay_adaptive import StubRequest
from spec_engine import LLM, SamplingParams
from spec_engine.adaptive import AdaptiveController
from spec_engine.config import parse_speculative_config
from spec_engine.engine import EngineConfig
from spec_engine.step import REGULAR, SPEC_CHAIN
from spec_engine.tree import PATH_LEAF, PATH_REJECTED, path_ranks
from spec_engine.tree_pricing import RescueRate, chain_evidence

WIDTHS = {1: 4, 4: 8}  # chains up to depth 4, dynamic trees of 4 a level up to depth 8
ALPHA, RESCUE = 0.7, 0.4  # the simulated row: its chain acceptance, and the tree's rescue rate


def request() -> StubRequest:
    return StubRequest(spec_state=None, params=SimpleNamespace(max_tokens=1 << 20, greedy=True), coupled=False,
                       output_token_ids=[], metrics=SimpleNamespace(alpha_estimate=None))  # fmt: skip


def simulated_ranks(rng: random.Random, width: int, gamma: int) -> list[int]:
    """One step's accepted path ranks for a row at ALPHA / RESCUE: per level the likeliest child is the target's
    token with probability ALPHA, else (trees) a lesser sibling with probability RESCUE, else the path ends there."""
    ranks = []
    while len(ranks) < gamma:
        if rng.random() < ALPHA:
            ranks.append(0)
        elif width > 1 and rng.random() < RESCUE:
            ranks.append(1)
        else:
            return [*ranks, PATH_REJECTED]
    return [*ranks, PATH_LEAF]


def drive(steep: float, num_steps: int = 400) -> list[tuple[int, int]]:
    """The controller over ``num_steps`` steps of one row, a target pass over T tokens costing
    ``r(T) = 1 + steep * (T - 1)`` plain passes of 10 ms and a draft forward 0.3 ms plus 10 us per node: the (width,
    depth) chosen at each drafted step."""
    ctl = AdaptiveController(max(WIDTHS.values()), lambda g: g + 1, widths=WIDTHS)
    rng, req, chosen = random.Random(0), request(), []
    for _ in range(num_steps):
        (gamma,) = ctl.choose([req])
        width = ctl.width if gamma else 0
        T = 1 + max(width, 1) * gamma
        ranks = simulated_ranks(rng, width, gamma) if gamma else [PATH_LEAF]
        draft = 0.0003 * gamma + 0.00001 * ctl.draft_tokens[gamma]
        step = 0.01 * (1.0 + steep * (T - 1)) + draft
        ctl.observe([req], [gamma], [len(ranks)], draft, step, ranks=[ranks] if width > 1 else None)
        req.output_token_ids.extend([0] * len(ranks))
        if gamma:
            chosen.append((width, gamma))
    return chosen


def tree_share(chosen: list[tuple[int, int]]) -> float:
    late = chosen[len(chosen) // 2 :]
    return sum(width > 1 for width, _ in late) / max(len(late), 1)


def test_a_flat_verify_cost_takes_trees_and_a_steep_one_chains():
    """The same row (chain acceptance ALPHA, rescue rate RESCUE): where a verify of a few more tokens costs about
    one (a Zen 4's r(T)), the k - 1 extra candidates a level are nearly free and the controller takes trees, deep
    ones; where each token costs a third of a pass (an AVX2 CPU's), it keeps chains. Either way it drafts."""
    flat, steep = drive(steep=0.01), drive(steep=0.3)
    assert len(flat) > 300 and len(steep) > 100
    assert tree_share(flat) > 0.9, flat[-20:]
    assert tree_share(steep) < 0.1, steep[-20:]
    assert sum(gamma for _, gamma in flat[-50:]) / 50 > 4  # (deeper than the chains' deepest)


def test_a_controller_blind_to_the_verify_width_is_caught(monkeypatch):
    """The planted bug: trees priced at a chain's verify width (its k - 1 extra nodes a level free), which the test
    above must report: under the steep r(T) the controller then takes trees."""
    honest = tree_pricing.shape_tables
    monkeypatch.setattr(tree_pricing, "shape_tables", lambda width, *args: honest(min(width, 1), *args))
    monkeypatch.setattr("spec_engine.adaptive.shape_tables", tree_pricing.shape_tables)
    assert tree_share(drive(steep=0.3)) > 0.5


def test_the_rescue_rate_and_chain_acceptance_are_learned_from_tree_steps():
    """Tree steps alone teach both: the row's chain acceptance near ALPHA (its count what a chain would have kept),
    the pooled rescue rate near RESCUE."""
    ctl = AdaptiveController(8, lambda g: g + 1, widths=WIDTHS)
    rng, req = random.Random(1), request()
    ctl.choose([req])
    for _ in range(3000):
        ctl.width = 4
        ranks = simulated_ranks(rng, 4, 8)
        ctl.observe([req], [8], [len(ranks)], 0.001, 0.01, ranks=[ranks])
    assert abs(ctl.state(req).acceptance.alpha - ALPHA) < 0.1
    assert abs(ctl.rescue[4].rate - RESCUE) < 0.05


# a dynamic tree of 2 a level, 3 deep, by hand: nodes 1, 2 the root's children (1 the likelier); 3, 4 on level 2 and
# 5, 6 on level 3, their parents as each case says
@pytest.mark.parametrize(
    "parents, path, ranks, evidence",
    [
        ([-1, 0, 0, 1, 2, 3, 4], [0, 1, 3, 5], [0, 0, 0, PATH_LEAF], (3, 3)),  # the likeliest all the way
        ([-1, 0, 0, 1, 2, 3, 4], [0, 2, 4, 6], [1, 0, 0, PATH_LEAF], (0, 1)),  # the root's lesser child: chain 0
        ([-1, 0, 0, 1, 1, 3, 4], [0, 1, 4, 6], [0, 1, 0, PATH_LEAF], (1, 2)),  # leaves the likeliest at depth 2
        ([-1, 0, 0, 1, 2, 3, 4], [0, 1], [0, PATH_REJECTED], (1, 2)),  # node 3 (1's likeliest) rejected
        ([-1, 0, 0, 2, 2, 3, 4], [0, 1], [0, PATH_LEAF], (1, 1)),  # node 1 kept no child: the chain's next unknown
        ([-1, 0, 0, 1, 2, 3, 4], [0], [PATH_REJECTED], (0, 1)),  # nothing accepted
    ],
)
def test_the_count_a_chain_would_have_kept(parents, path, ranks, evidence):
    assert path_ranks(parents, path) == ranks
    assert chain_evidence(ranks) == evidence


def test_rescues_count_lesser_siblings_and_misses_the_ends_short_of_the_depth():
    rate = RescueRate()
    rate.observe([1, 0, PATH_LEAF], 2)  # rescued at depth 1, then the likeliest: 1 rescue, no miss
    rate.observe([0, 1, PATH_REJECTED], 3)  # rescued at depth 2, missed at depth 3
    rate.observe([0, 0, 0, PATH_LEAF], 3)  # nothing missed
    assert rate.rescued == pytest.approx(2 * tree_pricing.RESCUE_DECAY**1, rel=1e-2)
    assert rate.missed == pytest.approx(1.0)


def _auto_llm(pair, method: str = "eagle", steps: int = 16) -> LLM:  # noqa: F811
    target, head = pair
    spec = {"method": method, "model": head, "tree": "auto", "eagle_topk": 3}
    return LLM(target, speculative_config=spec, dtype="float32", max_model_len=128,
               engine_config=EngineConfig(spec_chain_steps=steps, unsure_chain_steps=min(steps, 4)))  # fmt: skip


def _fixed_width(llm: LLM, monkeypatch, width: int, gamma: int = 3) -> dict:
    """Make ``llm``'s controller draft every row at ``gamma`` and ``width``; what it observes, per request (its
    ranks per step), into the returned dict."""
    ctl, seen = llm.engine.controller, {}
    observe = ctl.observe

    def record(reqs, gammas, counts, *args, ranks=None, **kw):
        for b, r in enumerate(reqs):
            if gammas[b]:
                seen.setdefault(r.request_id, []).append(ranks[b] if ranks is not None else None)
        return observe(reqs, gammas, counts, *args, ranks=ranks, **kw)

    def choose(reqs):
        ctl.width = width
        return [gamma] * len(reqs)

    monkeypatch.setattr(ctl, "choose", choose)
    monkeypatch.setattr(ctl, "observe", record)
    return seen


def test_native_ranks_are_the_python_rule_on_the_regular_steps_trees(pair, monkeypatch):  # noqa: F811
    """Width 3 every step: ``spec_chain``'s ranks (C++) equal ``path_ranks`` on the regular step's trees, step for
    step and row for row, and the paths left the likeliest child somewhere."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    native_llm, regular_llm = _auto_llm(pair), _auto_llm(pair, steps=0)
    native_seen = _fixed_width(native_llm, monkeypatch, 3)
    regular_seen = _fixed_width(regular_llm, monkeypatch, 3)
    native, regular = _run(native_llm, params, monkeypatch), _run(regular_llm, params, monkeypatch)
    assert native["tokens"] == regular["tokens"]
    assert any(p.path == SPEC_CHAIN for p in native["plans"]) and all(p.path == REGULAR for p in regular["plans"])
    assert list(native_seen.values()) == list(regular_seen.values())
    ranks = [r for rows in native_seen.values() for r in rows]
    assert len(ranks) > 10 and any(any(x > 0 for x in r[:-1]) for r in ranks)


@pytest.mark.parametrize("method", ["eagle", "hybrid"])
@pytest.mark.parametrize("steps", [16, 0])
def test_greedy_tokens_with_the_width_chosen_per_step_are_plain_decodings(pair, monkeypatch, method, steps):  # noqa: F811
    """The controller's own choices (chains and trees as its prices say), native calls or regular steps, EAGLE or
    the hybrid (suffix speculation beside the head): plain decoding's tokens. Each width forced in turn too."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = _run(LLM(pair[0], dtype="float32", max_model_len=128), params, monkeypatch)["tokens"]
    llm = _auto_llm(pair, method, steps)
    assert _run(llm, params, monkeypatch)["tokens"] == plain
    assert llm.engine.stats["num_drafted"] > 0
    for width in (1, 3):
        llm = _auto_llm(pair, method, steps)
        _fixed_width(llm, monkeypatch, width)
        out = _run(llm, params, monkeypatch)
        assert out["tokens"] == plain
        assert {p.width for p in out["plans"] if p.gamma or p.path == REGULAR} == {width}


def test_rejection_sampled_rows_draft_chains_and_coupled_rows_trees():
    """A dynamic tree is greedy and coupled rows' (its nodes point masses, a coupled row's walked on its perturbed
    argmax): with a rejection-sampled row in the batch the controller offers chains only; a coupled one takes trees."""
    ctl = AdaptiveController(8, lambda g: g + 1, widths=WIDTHS)
    sampled = request()
    sampled.params.greedy = False
    ctl.choose([request(), sampled])
    assert ctl.width == 1
    sampled.coupled = True
    ctl.choose([request(), sampled])
    assert ctl.width == 4


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "eagle", "tree": "auto", "num_speculative_tokens": 4}, "tree='auto' .* needs num_speculative_tok"),
        ({"method": "ngram", "tree": "auto"}, r"tree='auto' \(EAGLE-2's dynamic tree\) needs method='eagle' or"),
        ({"method": "suffix", "tree": "auto"}, r"tree='auto' \(EAGLE-2's dynamic tree\) needs method='eagle' or"),
        ({"method": "eagle", "tree": "auto", "eagle_topk": 1}, r"eagle_topk must be an int in \[2, 16\], got 1"),
        ({"method": "eagle", "tree": "auto", "eagle_topk": "3"}, r"eagle_topk must be an int in \[2, 16\], got '3'"),
        ({"method": "eagle", "eagle_topk": 3, "tree": "chain"}, "eagle_topk .* needs tree='dynamic' or 'auto'"),
        ({"method": "eagle", "eagle_topk": 3, "num_speculative_tokens": 4}, "eagle_topk .* needs tree='dynamic' or"),
        ({"method": "suffix", "tree": "chain"}, r"tree='chain' \(a model drafter's chains\) needs method="),
        ({"method": "eagle", "tree": "wide"}, "speculative_config.tree must be a list of positive ints"),
    ],
)
def test_bad_tree_width_settings_raise_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(spec)


def test_tree_auto_needs_an_eagle_head_not_a_draft_model(pair, tmp_path):  # noqa: F811
    target, _ = pair
    with pytest.raises(ValueError, match=r"tree='auto' \(EAGLE-2's dynamic tree\) needs an EAGLE head"):
        parse_speculative_config({"method": "hybrid", "model": target, "tree": "auto"})
    parsed = parse_speculative_config({"method": "eagle", "model": pair[1], "tree": "auto", "eagle_topk": 3})
    assert parsed["widths"] == {1: 4, 3: 8} and parsed["num_speculative_tokens"] == 8


def test_an_eagle_head_on_a_cpu_takes_tree_auto_by_default(pair):  # noqa: F811
    """Left out, an EAGLE head's tree is "auto" (k 3) where its depth is adaptive and the device a CPU, alone and in
    the hybrid, and the engine built so prices both widths; "chain" asks for the adaptive chains (depth 4), which a
    GPU keeps too, and a fixed depth and a draft model are untouched."""
    target, head = pair
    for method in ("eagle", "hybrid"):
        parsed = parse_speculative_config({"method": method, "model": head})
        assert parsed["tree"] == "auto" and parsed["widths"] == {1: 4, 3: 8}, method
    for spec, device in (({"tree": "chain"}, "cpu"), ({}, "cuda"), ({}, "cuda:0")):
        chains = parse_speculative_config({"method": "eagle", "model": head, **spec}, device)
        assert chains["tree"] is None and chains["widths"] is None and chains["num_speculative_tokens"] == 4
    assert parse_speculative_config({"method": "eagle", "model": head, "num_speculative_tokens": 3})["widths"] is None
    assert parse_speculative_config({"method": "hybrid", "model": target})["widths"] is None  # a draft model
    assert parse_speculative_config({"method": "eagle", "model": head, "eagle_topk": 5})["widths"] == {1: 4, 5: 8}
    llm = LLM(target, speculative_config={"method": "hybrid", "model": head}, dtype="float32", max_model_len=128)
    assert llm.speculative_config["tree"] == "auto" and llm.engine.controller.widths == {1: 4, 3: 8}
    chains = LLM(target, speculative_config={"method": "eagle", "model": head, "tree": "chain"}, dtype="float32",
                 max_model_len=128)  # fmt: skip
    assert chains.speculative_config["widths"] is None and chains.engine.gamma == 4


def test_eagle_topk_waits_for_the_hybrid_s_shipped_drafter(pair):  # noqa: F811
    """The hybrid named no drafter takes the one shipped for the target, known only once the target is loaded, so
    eagle_topk is checked when the drafter is: kept where it is an EAGLE head (tree "auto" then, the CLI's
    ``--eagle-topk 4`` with ``--model smollm2``), refused where it is a draft model."""
    target, head = pair
    first = parse_speculative_config({"method": "hybrid", "eagle_topk": 4})
    assert first["model_method"] is None  # LLM parses again with the shipped drafter, as below
    assert parse_speculative_config({"method": "hybrid", "eagle_topk": 4, "model": head})["widths"] == {1: 4, 4: 8}
    with pytest.raises(ValueError, match="eagle_topk .* needs tree='dynamic' or 'auto'"):
        parse_speculative_config({"method": "hybrid", "eagle_topk": 4, "model": target})
    with pytest.raises(ValueError, match="eagle_topk .* needs tree='dynamic' or 'auto'"):
        parse_speculative_config({"method": "hybrid", "eagle_topk": 4, "tree": "chain"})


def test_the_thread_tuner_compares_a_chain_and_a_tree_of_one_depth_apart(pair, monkeypatch):  # noqa: F811
    """tree='auto' runs chains and dynamic trees of one depth; a tree verifies 3x the tokens, so the thread tuner's
    windows must keep them apart: mixed, a probe's chain steps on one thread beat the other choice's tree steps and
    the engine decoded most of a run on one thread. Steps of width 1 and width 3 at depth 3 come with two kinds."""
    import torch

    torch.set_num_threads(2)
    llm = _auto_llm(pair)
    ctl, tuner, kinds = llm.engine.controller, llm.engine.threads, {}
    widths = iter([1, 3] * 100)

    def choose(reqs):
        ctl.width = next(widths)
        return [3] * len(reqs)

    def after_step(seconds, kind=None, steps=1):
        kinds.setdefault(ctl.width, set()).add(kind)

    monkeypatch.setattr(ctl, "choose", choose)
    monkeypatch.setattr(tuner, "after_step", after_step)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert kinds.keys() == {1, 3} and not kinds[1] & kinds[3], kinds
