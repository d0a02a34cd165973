"""The hybrid drafter (suffix speculation or the model drafter, per row and step): greedy parity with plain decoding
on the default pair, with a draft model and with an EAGLE head, and the chi-square losslessness test at temperature 1
with suffix rows and model rows in the same steps, with a planted bug."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from test_suffix import REPETITIVE, V, chi2_pvalue, exact_joint, joint_counts, sample
from tiny_models import make_model, make_noisy_copy

import spec_engine.drafters.hybrid as hybrid_module
from spec_engine import LLM, SamplingParams, default_model_paths
from spec_engine.drafters.hybrid import HybridDrafter
from spec_engine.drafters.suffix_ref import SuffixDraft

EAGLE_DIR = Path(default_model_paths()[0]).parent / "eagle"
PROMPTS = [*REPETITIVE, "The quick brown fox jumps over"]  # the last one is not repetitive: the model drafts it


class FakeSuffix:
    max_gamma, max_nodes, min_score, plain_chain_cap = 12, 13, 1.0, 8

    def __init__(self, scores):
        self.scores = iter(scores)

    def speculate(self, row, budget, tree=None):
        return SuffixDraft(score=next(self.scores))


class FakeModel:
    max_gamma, max_nodes, tree, kv, keeps_cache, needs_hidden, target_layers = 4, 5, None, None, True, False, None
    features = widths = None

    def nodes_for_gamma(self, gamma):
        return gamma + 1


def test_plan_compares_expected_accepted_tokens():
    """A row goes to the suffix speculation exactly where its score beats the model's expected accepted tokens (and
    reaches min_score); the others keep the controller's depth."""
    hybrid = HybridDrafter(FakeModel(), FakeSuffix([3.0, 0.5, 2.0, 0.9]))
    rows = [SimpleNamespace(greedy=True, score_trust=1.0, draft_room=99)] * 4
    plan = hybrid.plan(rows, [4, 0, 2, 0], gains=[2.5, 0.0, 2.5, 0.0])
    assert plan.suffix_rows == [True, False, False, False]  # 0.5 and 0.9 are below min_score
    assert plan.gammas == [12, 0, 2, 0]
    assert plan.nodes == [1, 1, 3, 1] and plan.expected == [3.0, 0.0, 2.5, 0.0]  # (the fake speculations are empty)


def test_where_steps_are_priced_the_faster_step_wins():
    """With the controller's prices (batch 1), a row goes to the suffix speculation where its step is faster in
    tokens per second, not where it promises more tokens: a wide tree promising 3 tokens loses to the model's chain
    promising 2.5 when it costs twice as much, and a narrow one promising less may win."""
    wide = SuffixDraft(list(range(15)), list(range(-1, 14)), [0.2] * 15, 3.0)
    narrow = SuffixDraft([1, 2], [-1, 0], [0.7, 0.5], 1.2)

    class Drafts(FakeSuffix):
        def speculate(self, row, budget, tree=None):
            return next(self.scores)

    rows = [SimpleNamespace(greedy=True, score_trust=1.0, draft_room=99)] * 2
    cost = {16: 2.0, 3: 1.0}  # seconds of a step verifying that many nodes; the model's chain: 3.5 tokens / 1.4 s

    def faster(b, nodes, tokens):
        return tokens / cost[nodes] > 3.5 / 1.4

    plan = HybridDrafter(FakeModel(), Drafts([wide, narrow])).plan(rows, [4, 4], [2.5, 2.5], faster)
    assert plan.suffix_rows == [False, False]  # 4 / 2 = 2 and 2.2 / 1 tokens a second: both slower than 2.5
    faster_narrow = lambda b, nodes, tokens: tokens / cost[nodes] > 1.5  # noqa: E731  (a slower model step)
    plan = HybridDrafter(FakeModel(), Drafts([wide, narrow])).plan(rows, [4, 4], [2.5, 2.5], faster_narrow)
    assert plan.suffix_rows == [True, True] and plan.nodes == [16, 3]


def test_a_request_whose_suffix_drafts_failed_goes_to_the_model():
    """The suffix side's score is scaled by what such scores kept on the request (RowView.score_trust): the same
    score of 3 wins against the model's 2.5 on a trusted request and loses on one whose speculations kept a third."""
    hybrid = HybridDrafter(FakeModel(), FakeSuffix([3.0, 3.0, 3.0]))
    rows = [SimpleNamespace(greedy=True, score_trust=t, draft_room=99) for t in (1.0, 0.6, 0.3)]
    plan = hybrid.plan(rows, [4, 4, 4], gains=[2.5, 0.5, 0.5])
    assert plan.suffix_rows == [True, True, False]  # 3 * 0.6 = 1.8 beats 0.5; 3 * 0.3 = 0.9 is below min_score
    assert plan.expected == [3.0, pytest.approx(1.8), 0.5]


def test_a_step_of_padded_trees_is_cut_until_it_pays():
    """Every row of a step is padded to its widest tree: with modelled costs (a pass of B * T tokens costs
    1 + 0.1 * B * T, a plain step 1 + 0.1 * B) the widest rows go undrafted until the step's expected tokens per
    second beat plain decoding's; a step that pays is left alone, and one that cannot pays nothing."""
    from spec_engine.drafters.base import DraftPlan
    from spec_engine.tree_pricing import priced_plan

    def pays(width, tokens, B=4):
        return tokens / (1 + 0.1 * width) > B / (1 + 0.1 * B)

    wide = DraftPlan([16, 3, 3, 0], [True, False, False, False], nodes=[17, 4, 4, 1], expected=[1.5, 1.8, 1.8, 0.0])
    cut = priced_plan(wide, pays)  # 68 tokens for 5.1 expected: no; without row 0, 16 tokens for 3.6: yes
    assert cut.gammas == [0, 3, 3, 0] and cut.suffix_rows == [False] * 4 and cut.nodes == [1, 4, 4, 1]
    assert priced_plan(cut, pays) == cut  # (16 tokens at 1 + 1.6 for 7.6 expected beats 4 at 1.4)
    hopeless = DraftPlan([8, 8, 0, 0], nodes=[9, 9, 1, 1], expected=[0.1, 0.1, 0.0, 0.0])
    assert priced_plan(hopeless, pays).gammas == [0, 0, 0, 0]


@pytest.mark.parametrize("model", ["draft", "eagle"])
@pytest.mark.parametrize("gamma", ["auto", 3])
def test_greedy_parity_on_the_default_pair(model, gamma):
    target, draft = default_model_paths()
    spec = {"method": "hybrid", "model": draft if model == "draft" else str(EAGLE_DIR), "num_speculative_tokens": gamma}
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = LLM(target, max_model_len=256).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(target, speculative_config=spec, max_model_len=256)
    assert isinstance(llm.engine.drafter, HybridDrafter)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(plain, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert llm.engine.stats["num_accepted"] > 0


def test_min_tokens_drafts_as_much_once_the_minimum_is_out():
    """``min_tokens`` holds the stop tokens back until that many tokens are out and nothing after: past the minimum a
    request takes the native calls as one without it does, so it accepts as much (before, it ran every step as the
    regular one, 22 regular steps against 5 here, on other call boundaries and prices), with plain decoding's tokens.
    Its first call is a regular step, so its calls end elsewhere, and a suffix match (which the global tree's
    anchors make from a request's first step) may draft other nodes there: the counts agree within a tenth, not
    exactly. (Before the minimum every drafted node is verified under the mask: tests/test_logits_processors.py.)"""
    target, _ = default_model_paths()
    spec = {"method": "hybrid", "num_speculative_tokens": 3}  # a fixed depth: no choice reads the clock

    def run(spec, min_tokens):
        llm = LLM(target, speculative_config=spec, max_model_len=256)
        outs = llm.generate(REPETITIVE, SamplingParams(max_tokens=48, min_tokens=min_tokens), use_tqdm=False)
        counts = [(o.metrics["num_drafted"], o.metrics["num_accepted"]) for o in outs]
        return [o.outputs[0].token_ids for o in outs], counts, llm.engine.stats["num_regular_steps"]

    plain, _, _ = run(None, 4)
    tokens, counts, regular = run(spec, 0)
    held_tokens, held_counts, held_regular = run(spec, 4)
    assert held_tokens == plain == tokens
    accepted, held_accepted = sum(a for _, a in counts), sum(a for _, a in held_counts)
    assert accepted > 0 and abs(held_accepted - accepted) <= 0.1 * accepted, (held_counts, counts)
    assert held_regular <= regular + 1  # (the first call, before the minimum, is a regular step)


# --- losslessness at temperature 1 --------------------------------------------------------------------------------

REPEATS = [1, 2, 3, 1, 2, 3, 1, 2]  # the suffix speculation beats the model here (score > 0.96)...
NOVEL = [4, 0, 5, 2]  # ... and has nothing to say here: the model drafts these rows
N = 3000
P_MIN = 1e-4
P_BUG = 1e-8
SPEC = {"method": "hybrid", "num_speculative_tokens": 2, "suffix_decoding_min_score": 0.0,
        "suffix_decoding_min_token_prob": 0.0}  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_sampling")
    target = make_model(root / "target", "llama_gqa", vocab_size=V, hidden=32, logit_scale=2.0)
    return target, make_noisy_copy(target, root / "draft", noise=0.5)


def test_first_two_tokens_follow_the_target(pair):
    """Both prompts in one batch: every step mixes suffix rows (chains with one-hot proposals) and model rows
    (sampled from the draft's q); each prompt's first two tokens follow the target's exact joint."""
    target, draft = pair
    llm = LLM(str(target), speculative_config={**SPEC, "model": str(draft)}, max_model_len=32, max_num_seqs=512)
    outputs = sample(llm, [REPEATS, NOVEL] * N)
    assert llm.engine.stats["num_accepted"] > N // 2, "the drafts must be accepted often for this test to bite"
    assert chi2_pvalue(joint_counts(outputs[0::2]), exact_joint(target, REPEATS)) > P_MIN
    assert chi2_pvalue(joint_counts(outputs[1::2]), exact_joint(target, NOVEL)) > P_MIN


def test_planted_bug_is_rejected(pair, monkeypatch):
    """A suffix node's one-hot proposal written at its own column, not its parent's: the verifier then sees q = 0 for
    the drafted token, accepts it always, and chi2 must see it."""

    def misplaced(probs, drafts):
        for b, d in enumerate(drafts):
            for i, t in enumerate(d.tokens):
                probs[b, i + 1, t] = 1.0

    monkeypatch.setattr(hybrid_module, "one_hot_proposals", misplaced)
    target, draft = pair
    llm = LLM(str(target), speculative_config={**SPEC, "model": str(draft)}, max_model_len=32, max_num_seqs=512)
    outputs = sample(llm, [REPEATS, NOVEL] * N)
    assert chi2_pvalue(joint_counts(outputs[0::2]), exact_joint(target, REPEATS)) < P_BUG


def test_a_hybrid_without_model_takes_the_shipped_drafter():
    """{"method": "hybrid"} with no "model" wraps the drafter shipped for the target (the embedded target's draft
    model); the CLI picks the hybrid where a model drafter exists and suffix decoding where none does."""
    from spec_engine.drafters.draft_model import DraftModelDrafter
    from spec_engine.llm import default_method

    target, draft = default_model_paths()
    llm = LLM(target, {"method": "hybrid"}, max_num_seqs=1)
    assert isinstance(llm.engine.drafter, HybridDrafter) and isinstance(llm.engine.drafter.model, DraftModelDrafter)
    assert llm.speculative_config["model"] == draft
    assert default_method(target, None) == "hybrid"
    assert default_method(target, draft) == "hybrid"


def test_the_cli_default_is_suffix_where_no_drafter_is_shipped(tmp_path):
    from spec_engine.llm import default_method

    make_model(tmp_path / "tiny", "llama_gqa", vocab_size=V, seed=0)
    assert default_method(tmp_path / "tiny", None) == "suffix"
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "tiny"), {"method": "hybrid"})
