"""Suffix decoding: the C++ tree against its Python reference, the reference against brute force, the global tree's
bound, and the drafter end to end (greedy parity with plain decoding, and the chi-square losslessness test with a
planted bug)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny_models import make_model

from spec_engine import LLM, SamplingParams, default_model_paths
from spec_engine.drafters.base import RowView
from spec_engine.drafters.suffix import NativeSuffixTree, SuffixDrafter
from spec_engine.drafters.suffix_ref import SuffixCache, SuffixTreeRef
from spec_engine.request import ScoreTrust

TREES = {"reference": SuffixTreeRef, "native": NativeSuffixTree}


def occurrences(seqs: list[list[int]], s: list[int]) -> int:
    n = len(s)
    return sum(seq[i : i + n] == s for seq in seqs for i in range(len(seq) - n + 1))


def random_streams(rng: random.Random, num_seqs: int, length: int, vocab: int) -> list[list[int]]:
    """Token streams with repeats (copied spans), so the tree has deep shared paths and ties."""
    out = []
    for _ in range(num_seqs):
        seq = []
        while len(seq) < length:
            if seq and rng.random() < 0.4:
                start = rng.randrange(len(seq))
                seq += seq[start : start + rng.randint(1, 8)]
            else:
                seq.append(rng.randrange(vocab))
        out.append(seq[:length])
    return out


def same_speculation(a, b) -> bool:
    return (a.tokens, a.parents, a.probs, a.score, a.match_len) == (b.tokens, b.parents, b.probs, b.score, b.match_len)


@pytest.mark.parametrize("make_tree", list(TREES.values()), ids=list(TREES))
def test_frequencies_are_occurrence_counts(make_tree):
    rng = random.Random(1)
    seqs = random_streams(rng, 3, 60, 4)
    tree = make_tree(5)
    for i, seq in enumerate(seqs):
        tree.extend(i, seq[:25])
        tree.extend(i, seq[25:])
    for n in range(1, 7):
        for s in itertools.product(range(4), repeat=n):
            expected = occurrences(seqs, list(s)) if n <= 5 else 0  # strings past max_depth are not indexed
            assert tree.frequency(s) == expected, s


@pytest.mark.parametrize("seed", range(6))
def test_native_matches_reference(seed):
    """Random streams through both trees: every count, node count and speculation agrees exactly, before and after
    removing sequences, down to the empty tree."""
    rng = random.Random(seed)
    depth = rng.choice([1, 3, 8, 24])
    vocab = rng.choice([3, 5, 50])
    ref, native = SuffixTreeRef(depth), NativeSuffixTree(depth)
    seqs = random_streams(rng, 5, rng.randint(20, 120), vocab)
    for i, seq in enumerate(seqs):  # interleaved appends of several lengths
        cut = rng.randint(0, len(seq))
        for tree in (ref, native):
            tree.extend(i, seq[:cut])
    for i, seq in enumerate(seqs):
        cut = len(seq) - rng.randint(0, len(seq))
        for tree in (ref, native):
            tree.extend(i, seq[len(seq) - cut :] if cut else [])
    order = list(range(len(seqs)))
    rng.shuffle(order)
    for removed in [None, *order]:
        if removed is not None:
            ref.remove(removed)
            native.remove(removed)
        assert ref.num_nodes() == native.num_nodes()
        assert ref.num_seqs == native.num_seqs
        for _ in range(40):
            seq = rng.choice(seqs)
            start = rng.randrange(len(seq))
            s = seq[start : start + rng.randint(1, depth + 1)]
            assert ref.frequency(s) == native.frequency(s)
            context = seq[: rng.randint(1, len(seq))] + ([rng.randrange(vocab)] if rng.random() < 0.3 else [])
            args = (rng.randint(0, 20), rng.choice([0.5, 1.0, 2.5]), rng.choice([0.0, 0.1, 0.3]), rng.random() < 0.7)
            assert same_speculation(ref.speculate(context, *args), native.speculate(context, *args)), args
    assert ref.num_nodes() == native.num_nodes() == 0


@pytest.mark.parametrize("factor", [1e18, 1e19, 1e300])
def test_native_matches_reference_at_huge_spec_factors(factor):
    """A max_spec_factor whose budget overflows int64 (any finite factor passes the config) still caps the
    speculation at max_tokens, as the reference's unbounded int does, instead of drafting nothing."""
    ref, native = SuffixTreeRef(8), NativeSuffixTree(8)
    for tree in (ref, native):
        tree.extend(0, [1, 2, 3] * 4)
    for max_tokens in (0, 5, 2**62):
        want = ref.speculate([1, 2], max_tokens, factor, 0.1)
        assert same_speculation(want, native.speculate([1, 2], max_tokens, factor, 0.1))
        assert len(want.tokens) == min(max_tokens, 7)  # (the chain ends at the tree's depth)


def test_a_bad_token_id_leaves_the_native_tree_as_it_was():
    tree = NativeSuffixTree(4)
    tree.extend(0, [1, 2])
    for bad in ([3, 2**31], [-1]):
        with pytest.raises(ValueError, match="token ids"):
            tree.extend(1, bad)
    assert (tree.num_seqs, tree.num_nodes(), tree.frequency([3])) == (1, 3, 0)


def test_speculation_by_hand():
    tree = SuffixTreeRef(8)
    tree.extend(0, [1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    # "1 2" occurs 3 times, twice followed by 3; "2 3" then goes on with 4 or 5 (a tie: the latest seen, 5, first)
    draft = tree.speculate([7, 1, 2], max_tokens=3, max_spec_factor=2.0, min_token_prob=0.1)
    assert draft.match_len == 2 and draft.tokens == [3, 5, 4] and draft.parents == [-1, 0, 0]
    assert draft.probs == pytest.approx([2 / 3, 1 / 3, 1 / 3]) and draft.score == pytest.approx(4 / 3)
    chain = tree.speculate([7, 1, 2], max_tokens=3, max_spec_factor=2.0, min_token_prob=0.1, tree=False)
    assert chain.tokens == [3, 5, 1] and chain.parents == [-1, 0, 1]
    assert tree.speculate([7, 1, 2], 3, 2.0, min_token_prob=0.5).tokens == [3]  # 1/3 < 0.5: pruned
    assert tree.speculate([9], 3, 2.0, 0.1).tokens == []  # nothing matches


@pytest.mark.parametrize("seed", range(3))
def test_speculation_invariants(seed):
    rng = random.Random(seed)
    tree = SuffixTreeRef(12)
    seqs = random_streams(rng, 3, 200, 6)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
    for _ in range(50):
        context = rng.choice(seqs)[: rng.randint(1, 200)]
        budget, factor, min_prob = rng.randint(1, 16), rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.4])
        d = tree.speculate(context, budget, factor, min_prob)
        assert len(d.tokens) <= min(budget, int(d.match_len * factor + 1e-6))
        assert all(-1 <= p < i for i, p in enumerate(d.parents))
        assert all(q >= min_prob for q in d.probs)
        assert all(d.probs[i] <= (1.0 if p < 0 else d.probs[p]) for i, p in enumerate(d.parents))
        assert d.score == pytest.approx(sum(d.probs))


@pytest.mark.parametrize("make_tree", list(TREES.values()), ids=list(TREES))
def test_global_tree_keeps_the_last_requests(make_tree):
    """The global tree holds the outputs of the last max_cached_requests requests (active ones included), each behind
    its prompt's last max_depth - 1 tokens, oldest evicted first, and a finished request's own tree is dropped."""
    cache = SuffixCache(max_depth=6, max_cached_requests=3, make_tree=make_tree)
    prompt = np.array([9, 8, 7, 6, 5, 4, 1, 2, 3])  # its anchor: the last 5 tokens
    for key in range(10):
        output = [100 + key, 200 + key, 300 + key]  # one unique trigram per request
        tokens = np.concatenate([prompt, output])
        cache.update(key, tokens[:10], num_prompt_tokens=9)
        cache.update(key, tokens, num_prompt_tokens=9)
        cache.finish(key)
        assert len(cache.cached_requests) <= 3 and cache.active_requests == []
    assert cache.cached_requests == [7, 8, 9]
    assert cache.global_tree.num_seqs == 3
    for key in range(10):
        expected = 1 if key >= 7 else 0
        assert cache.global_tree.frequency([1, 2, 3, 100 + key, 200 + key, 300 + key]) == expected
    assert cache.global_tree.frequency([5, 4, 1, 2, 3]) == 3  # each cached request's anchor, once
    assert cache.global_tree.frequency([6, 5]) == 0  # the rest of the prompts stay in their requests' own trees
    # the anchor's 5 suffixes are shared (5 + 4 + 3 + 2 + 1 nodes); run on into an output, up to 6 tokens long, they
    # add 1 + 2 + 3 + 3 + 3 nodes of their own, and the output's own suffixes 3 + 2 + 1
    assert cache.global_tree.num_nodes() == 15 + 3 * (12 + 6)


@pytest.mark.parametrize("make_tree", list(TREES.values()), ids=list(TREES))
def test_a_finished_requests_last_tokens_join_the_global_tree(make_tree):
    """The tokens a request's last step emitted were never speculated from (no step after them): finishing with its
    final history indexes them, so a repeat of the request is drafted to its very end."""
    cache = SuffixCache(max_depth=8, max_cached_requests=10, make_tree=make_tree)
    tokens = np.array([5, 6, 7, 8, 9, 10, 11])
    cache.update(0, tokens[:4], num_prompt_tokens=2)  # (its last speculation: three of its tokens out)
    cache.finish(0, tokens, num_prompt_tokens=2)
    assert cache.global_tree.frequency([7, 8, 9, 10, 11]) == 1
    cache.update(1, np.array([5, 6, 7, 8, 9]), num_prompt_tokens=2)
    assert cache.speculate(1, np.array([5, 6, 7, 8, 9]), 4, 4.0, 0.1).tokens == [10, 11]


def test_the_engine_hands_a_finished_requests_last_tokens_to_suffix_decoding():
    """Through the engine: a request's answer is in the global tree to its very end, its last step's tokens (and a
    stop token) included."""
    from spec_engine import LLM, SamplingParams, default_model_paths

    llm = LLM(default_model_paths()[0], speculative_config={"method": "suffix"}, max_model_len=256)
    for params in (SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[0])):  # fmt: skip
        out = llm.generate("one two three four one two three four", params, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.engine.drafter.cache.global_tree.frequency(out[-4:]) >= 1, out


@pytest.mark.parametrize("make_tree", list(TREES.values()), ids=list(TREES))
def test_global_tree_serves_a_repeated_request_from_its_first_step(make_tree):
    """A request served again is drafted its answer at its first step, from a match in its anchor. An output indexed
    without its anchor would match nothing there, and one token at the second step. The trie's strings are at most
    max_depth tokens, match and draft together, and max_spec_factor 1 drafts at most one node per matched token: the
    longest draft is max_depth / 2."""
    cache = SuffixCache(max_depth=8, max_cached_requests=10, make_tree=make_tree)
    prompt, answer = [20, 21, 22, 23, 24, 25, 26, 27, 28], [30, 31, 32, 33, 34, 35, 36, 37]
    cache.update(0, np.array(prompt + answer[:1]), num_prompt_tokens=9)
    cache.finish(0, np.array(prompt + answer), num_prompt_tokens=9)
    cache.update(1, np.array(prompt), num_prompt_tokens=9)  # the same request again, nothing emitted yet
    draft = cache.speculate(1, np.array(prompt), 6, 1.0, 0.1)
    assert draft.tokens == answer[:4] and draft.match_len == 4
    cache.update(2, np.array([40, 41, 42]), num_prompt_tokens=3)  # another request's context matches no anchor
    assert cache.speculate(2, np.array([40, 41, 42]), 6, 1.0, 0.1).tokens == []


def test_a_request_served_again_is_drafted_whole_from_its_first_step():
    """Through the engine, at a fixed depth of 16 nodes (no choice reads the clock): the second time, every step
    drafts up to the 16-node budget and keeps it (17 tokens a step), from the first; without the anchors the drafts
    grow from one token over the first steps (13 steps). The prompt is longer than 16 tokens: a short anchor matches,
    and so drafts, less."""
    from spec_engine import LLM, SamplingParams, default_model_paths

    spec = {"method": "suffix", "num_speculative_tokens": 16}
    llm = LLM(default_model_paths()[0], speculative_config=spec, max_model_len=256)
    params = SamplingParams(max_tokens=68, temperature=0.0, ignore_eos=True)
    prompt = "Once upon a time there was a small town by the sea where every morning the fishermen went out to"
    first, again = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.metrics["num_steps"] <= 68 // 17 + 1, again.metrics  # (one step may branch where the answer repeats)


# --- the drafter in the engine ------------------------------------------------------------------------------------

REPETITIVE = [  # the embedded target's vocabulary: prompts that repeat, so that drafts are accepted
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "one two three four one two three four one two three four one two",
    "Hello world. Hello world. Hello world. Hello",
]


@pytest.mark.parametrize("spec", [
    {"method": "suffix"},
    {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_use_tree_spec": False},
    {"method": "suffix", "num_speculative_tokens": 12, "suffix_decoding_min_score": 0.0},
], ids=["auto", "chains", "fixed"])  # fmt: skip
def test_greedy_parity_on_the_default_pair(spec):
    target, _ = default_model_paths()
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = LLM(target, max_model_len=256).generate(REPETITIVE, params, use_tqdm=False)
    llm = LLM(target, speculative_config=spec, max_model_len=256)
    outs = llm.generate(REPETITIVE, params, use_tqdm=False)
    again = llm.generate(REPETITIVE[:1], params, use_tqdm=False)  # served again: the global tree knows its output
    for a, b in zip(plain, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert again[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.stats["num_accepted"] > 0, "the drafts must be accepted for parity to mean anything"


def test_score_trust_follows_what_the_speculations_kept():
    """A request's score trust starts at 1 (scores taken as promised), falls where its speculations keep less than
    their scores promise and recovers where they keep it: chat prose, then a verbatim repeat."""
    trust = ScoreTrust()
    assert trust.value == 1.0
    for _ in range(4):
        trust.observe(3.0, 0)  # scores of 3 that kept nothing
    low = trust.value
    assert low < 0.25
    for _ in range(8):
        trust.observe(6.0, 6)  # a repeated passage: all kept
    assert trust.value > 0.9 > low


def test_the_suffix_plan_scales_scores_by_the_requests_trust():
    """A speculation is drafted where its score times the request's trust reaches min_score, and the step is priced
    with that (the plan's expected tokens)."""
    target, _ = default_model_paths()
    drafter = LLM(target, speculative_config={"method": "suffix"}, max_model_len=256).engine.drafter
    ids = np.array([5, 6, 7, 8] * 6 + [5], dtype=np.int64)  # "6 7 8 5 ..." follows with certainty
    trusted, doubted = (RowView(ids, len(ids) - 1, 0, True, key=k, score_trust=t) for k, t in ((1, 1.0), (2, 0.01)))
    plan = drafter.plan([trusted, doubted], [8, 8])
    assert plan.gammas == [8, 0] and plan.expected[0] >= 1.0 and plan.expected[1] == 0.0


def test_a_grammars_forced_chain_is_sure():
    """A row whose grammar forces tokens (RowView.forced) drafts them whatever its trust (a forced chain is no
    match, so no trust scales it), and the plan marks it sure, so its acceptance teaches the trust nothing; the
    hybrid compares it, unscaled, with the model drafter's gain."""
    target, _ = default_model_paths()
    drafter = LLM(target, speculative_config={"method": "suffix"}, max_model_len=256).engine.drafter
    ids = np.array([5, 6, 7, 8] * 6 + [5], dtype=np.int64)
    forced, matched = (RowView(ids, len(ids) - 1, 0, True, key=k, score_trust=0.01, forced=f)
                       for k, f in ((1, (9,)), (2, ())))  # fmt: skip
    plan = drafter.plan([forced, matched], [8, 8])
    assert plan.gammas == [8, 0] and plan.expected[0] == 1.0 and plan.sure == [True, False]
    hybrid = LLM(target, speculative_config={"method": "hybrid"}, max_model_len=256).engine.drafter
    plan = hybrid.plan([forced, forced], [3, 3], gains=[0.5, 1.5])
    assert plan.suffix_rows == [True, False] and plan.sure == [True, False]


def test_suffix_rows_teach_their_requests_trust():
    """In the engine, every suffix-drafted step tells the request's trust what its speculation kept (parity holds)."""
    target, _ = default_model_paths()
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = LLM(target, max_model_len=256).generate(REPETITIVE, params, use_tqdm=False)
    llm = LLM(target, speculative_config={"method": "suffix"}, max_model_len=256)
    seen = []
    real = ScoreTrust.observe

    def spy(self, expected, accepted):
        seen.append((expected, accepted))
        real(self, expected, accepted)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ScoreTrust, "observe", spy)
        outs = llm.generate(REPETITIVE, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert len(seen) > 0 and sum(a for _, a in seen) == llm.engine.stats["num_accepted"]
    assert all(e > 0 for e, _ in seen)


@pytest.mark.parametrize("method, gamma", [("suffix", "auto"), ("suffix", 12), ("hybrid", None)])
def test_speculations_draft_no_deeper_than_the_request_can_keep(method, gamma):
    """A request's last steps: suffix speculation, alone or as the hybrid's suffix rows, is cut to the tokens the
    request can still keep (its tokens left but one), as the engine cuts a model drafter's depth; under "auto" the
    controller offers every row the largest budget, and a tree of 16 nodes on a request's last token was verified
    for nothing."""
    target, draft = default_model_paths()
    spec = {"method": "suffix", "num_speculative_tokens": gamma, "suffix_decoding_min_score": 0.0}
    if method == "hybrid":
        spec = {"method": "hybrid", "model": draft}
    llm = LLM(target, speculative_config=spec, max_model_len=256)
    prompt = REPETITIVE[1]
    llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)  # the loop, indexed
    for max_tokens in (1, 3):
        llm.engine.gamma_history.clear()
        out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
        assert max(llm.engine.gamma_history, default=0) <= max_tokens - 1, list(llm.engine.gamma_history)
        assert len(out.outputs[0].token_ids) == max_tokens


def test_finished_requests_leave_the_drafter():
    target, _ = default_model_paths()
    llm = LLM(target, speculative_config={"method": "suffix", "suffix_decoding_max_cached_requests": 2},
              max_model_len=256)  # fmt: skip
    llm.generate(REPETITIVE, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    cache = llm.engine.drafter.cache
    assert cache.active_requests == [] and len(cache.cached_requests) == 2


# --- losslessness at temperature 1 --------------------------------------------------------------------------------

V = 6
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: the suffix trees propose "3 1 ..." from the first step
N = 3000
P_MIN = 1e-4  # a correct engine fails one run in 10^4
P_BUG = 1e-8


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("suffix_sampling") / "target", "llama_gqa", vocab_size=V, hidden=32,
                      logit_scale=2.0)  # fmt: skip


def exact_joint(target, prompt: list[int]) -> np.ndarray:
    """[V * V] exact P(x1, x2) of the target at temperature 1 (HF transformers' own model, float64)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()

    def dist(ids):
        with torch.no_grad():
            return torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1).numpy()

    p1 = dist(prompt)
    return np.concatenate([p1[a] * dist(prompt + [a]) for a in range(V)])


def sample(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """The output tokens of seeded requests for ``prompts``, all served in one batch (rejection sampling, not the
    coupling). Three tokens each: the first step may draft two deep."""
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=1000 + i, invariant=False)
              for i in range(len(prompts))]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def joint_counts(outputs: list[list[int]]) -> np.ndarray:
    """Counts [V * V] of the outputs' first two tokens."""
    counts = np.zeros(V * V)
    for tokens in outputs:
        counts[tokens[0] * V + tokens[1]] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    small = expected < 5  # pool sparse cells so the chi2 approximation holds
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


SUFFIX_SAMPLING = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_score": 0.0,
                   "suffix_decoding_min_token_prob": 0.0}  # fmt: skip


@pytest.mark.parametrize("use_tree", [True, False], ids=["trees", "chains"])
def test_first_two_tokens_follow_the_target(tiny_target, use_tree):
    spec = {**SUFFIX_SAMPLING, "suffix_decoding_use_tree_spec": use_tree}
    llm = LLM(str(tiny_target), speculative_config=spec, max_model_len=32, max_num_seqs=512)
    counts = joint_counts(sample(llm, [PROMPT] * N))
    assert llm.engine.stats["num_accepted"] > N // 4, "the drafts must be accepted often for this test to bite"
    assert chi2_pvalue(counts, exact_joint(tiny_target, PROMPT)) > P_MIN


def test_planted_bug_is_rejected(tiny_target, monkeypatch):
    """Deterministic speculations reported as drawn from a uniform q: verification then accepts a drafted token
    with probability min(1, p / q) instead of p, and chi2 must see it."""
    propose = SuffixDrafter.propose

    def as_if_sampled(self, batch):
        draft = propose(self, batch)
        B, T = draft.tokens.shape
        draft.draft_probs, draft.draft_sampling = torch.full((B, T, V), 1.0 / V), "iid"
        return draft

    monkeypatch.setattr(SuffixDrafter, "propose", as_if_sampled)
    llm = LLM(str(tiny_target), speculative_config=SUFFIX_SAMPLING, max_model_len=32, max_num_seqs=512)
    counts = joint_counts(sample(llm, [PROMPT] * N))
    assert chi2_pvalue(counts, exact_joint(tiny_target, PROMPT)) < P_BUG
