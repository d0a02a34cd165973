"""Lossless sampling end to end: the engine's first two sampled tokens follow the target's exact joint distribution.

The exact distribution comes from HF transformers (its own model and its own warpers, an independent spec), the
samples from thousands of seeded requests through the whole engine: drafting, tree attention, verification, KV
compaction. A planted bug (children drawn greedily while claimed to be sampled from q) must be rejected.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny_models import make_model, make_noisy_copy

from spec_engine import LLM, SamplingParams
from spec_engine.drafters.draft_model import DraftModelDrafter

V = 6
PROMPT = [1, 2, 3, 4]
N = 3000
P_MIN = 1e-4  # a correct engine fails one run in 10^4
P_BUG = 1e-8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target = make_model(root / "target", "llama_gqa", vocab_size=V, hidden=32, logit_scale=2.0)
    draft = make_noisy_copy(target, root / "draft", noise=0.5)
    return target, draft


def exact_joint(target, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0) -> np.ndarray:
    """[V * V] exact P(x1, x2) of the HF-warped target (temperature, top-k, top-p, min-p: HF's order)."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()

    def dist(ids):
        with torch.no_grad():
            z = model(torch.tensor([ids])).logits[:, -1].double()
        z = TemperatureLogitsWarper(temperature)(None, z)
        if top_k:
            z = TopKLogitsWarper(top_k)(None, z)
        if top_p < 1:
            z = TopPLogitsWarper(top_p)(None, z)
        if min_p:
            z = MinPLogitsWarper(min_p)(None, z)
        return torch.softmax(z, -1)[0].numpy()

    p1 = dist(PROMPT)
    return np.concatenate([p1[a] * dist(PROMPT + [a]) for a in range(V)])


def sample_joint(llm: LLM, temperature: float, top_p: float, invariant: bool = False, **filters) -> np.ndarray:
    """Counts [V * V] of the first two tokens of N seeded requests; ``invariant=False`` keeps rejection sampling
    (seeded requests are coupled by default), ``True`` samples through the position-keyed coupling."""
    params = [SamplingParams(max_tokens=2, temperature=temperature, top_p=top_p, seed=1000 + i, invariant=invariant,
                             **filters) for i in range(N)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    counts = np.zeros(V * V)
    for o in outs:
        a, b = o.outputs[0].token_ids
        counts[a * V + b] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    small = expected < 5  # pool sparse cells so the chi2 approximation holds
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


CASES = [(t, p, "without_replacement") for t, p in itertools.product([[1, 1], [2, 2]], [1.0, 0.8])]
CASES += [([2, 2], 0.8, "iid"), ([3, 1], 1.0, "deterministic")]


@pytest.mark.parametrize("tree,top_p,mode", CASES, ids=[f"tree{t}-top_p{p}-{m}" for t, p, m in CASES])
def test_first_two_tokens_follow_the_target(pair, tree, top_p, mode):
    target, draft = pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2, "tree": tree,
            "draft_sampling": mode}  # fmt: skip
    llm = LLM(str(target), speculative_config=spec, max_model_len=32, max_num_seqs=512)
    counts = sample_joint(llm, 1.0, top_p)
    assert llm.engine.stats["num_accepted"] > N // 4, "the draft must be accepted often for this test to bite"
    assert chi2_pvalue(counts, exact_joint(target, 1.0, top_p)) > P_MIN


def test_planted_bug_is_rejected(pair, monkeypatch):
    """Children taken greedily but reported as drawn from q: acceptance is then biased, and chi2 must see it."""
    target, draft = pair

    def greedy_children(self, q, b, greedy, keys, *coupling):
        return q.topk(b, dim=-1).indices

    monkeypatch.setattr(DraftModelDrafter, "_draw_children", greedy_children)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    llm = LLM(str(target), speculative_config=spec, max_model_len=32, max_num_seqs=512)
    assert chi2_pvalue(sample_joint(llm, 1.0, 1.0), exact_joint(target, 1.0, 1.0)) < P_BUG


def test_no_speculation_sampling_follows_the_target(pair):
    target, _ = pair
    llm = LLM(str(target), max_model_len=32, max_num_seqs=512)
    assert chi2_pvalue(sample_joint(llm, 0.7, 1.0), exact_joint(target, 0.7, 1.0)) > P_MIN


def test_seed_gives_the_same_output_alone_and_in_a_batch(pair):
    target, draft = pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "tree": [2, 1]}
    llm = LLM(str(target), speculative_config=spec, max_model_len=64)
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    alone = llm.generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in (1, 2)]
    batch = llm.generate([{"prompt_token_ids": [5, 1]}, {"prompt_token_ids": PROMPT}, {"prompt_token_ids": [2]}],
                         [others[0], p, others[1]], use_tqdm=False)  # fmt: skip
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=12, temperature=1.0, seed=8),
                         use_tqdm=False)  # fmt: skip
    assert again[0].outputs[0].token_ids != alone or V < 3  # a different seed samples differently (V^12 outcomes)


# --- the position-keyed coupling (seeded requests: spec_engine/coupling.py) --------------------------------------

COUPLED = [
    ({"num_speculative_tokens": 2}, {}),
    ({"num_speculative_tokens": 2, "tree": [2, 2]}, {"top_k": 4}),
    ({"num_speculative_tokens": 3}, {"top_p": 0.8, "min_p": 0.05}),
    (None, {"top_k": 3, "min_p": 0.1}),
]


@pytest.mark.parametrize("spec,filters", COUPLED, ids=["chain2", "tree22-topk", "chain3-topp-minp", "none-topk-minp"])
def test_coupled_first_two_tokens_follow_the_target(pair, spec, filters):
    """The coupling is an exact sampler: over N seeds its first two tokens follow the transformed joint."""
    target, draft = pair
    if spec is not None:
        spec = {"method": "draft_model", "model": str(draft), **spec}
    llm = LLM(str(target), speculative_config=spec, max_model_len=32, max_num_seqs=512)
    f = {"top_p": 1.0, **filters}
    counts = sample_joint(llm, 0.9, invariant=True, **f)
    if spec is not None:
        assert llm.engine.stats["num_accepted"] > N // 4, "the draft must be accepted often for this test to bite"
    exact = exact_joint(target, 0.9, f["top_p"], f.get("top_k", 0), f.get("min_p", 0.0))
    assert chi2_pvalue(counts, exact) > P_MIN


def test_coupling_planted_bug_is_rejected(pair, monkeypatch):
    """Exponential noise instead of Gumbel in the target's verify (argmax(z + E) is no Gumbel-max sample): chi2 must
    see it."""
    import importlib

    from spec_kernels import rng

    vt = importlib.import_module("spec_kernels.verify_tree.cpu")  # the engine's CPU verify: its noise from vt.gumbel
    target, draft = pair
    monkeypatch.setattr(vt, "gumbel", lambda keys, shape: -torch.log(rng.uniform(keys, shape)))
    llm = LLM(str(target), speculative_config={"model": str(draft), "num_speculative_tokens": 2}, max_model_len=32,
              max_num_seqs=512)  # fmt: skip
    assert chi2_pvalue(sample_joint(llm, 1.0, 1.0, invariant=True), exact_joint(target, 1.0, 1.0)) < P_BUG


def test_sampled_drafts_below_temperature_one_follow_the_target(pair):
    """At temperature 0.5 both the draft's draws and the q handed to verification are softmax(logits / 0.5): a q
    taken at another temperature than the draws passes every temperature-1 test above, and fails this one."""
    target, draft = pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2, "tree": [2, 2]}
    llm = LLM(str(target), speculative_config=spec, max_model_len=32, max_num_seqs=512)
    counts = sample_joint(llm, 0.5, 1.0)
    assert llm.engine.stats["num_accepted"] > N // 4, "the draft must be accepted often for this test to bite"
    assert chi2_pvalue(counts, exact_joint(target, 0.5, 1.0)) > P_MIN


def test_each_level_draws_from_its_own_stream(pair, monkeypatch):
    """Verification reads q_d as the law of level d's draw given the path above it, so a level's draws must not
    reuse an earlier level's noise: every (step, level) draws with its own key. (One key for every level of a step
    biases the deeper draws towards the shallower ones' choices, too weakly for the chi2 tests above to see.)"""
    target, draft = pair
    keys = []
    honest = DraftModelDrafter._draw_children

    def spy(self, q, b, greedy, level_keys, *rest):
        keys.append(level_keys.tolist())
        return honest(self, q, b, greedy, level_keys, *rest)

    monkeypatch.setattr(DraftModelDrafter, "_draw_children", spy)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec, max_model_len=64)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, invariant=False) for s in (1, 2)]
    llm.generate([{"prompt_token_ids": PROMPT}] * 2, params, use_tqdm=False)
    drawn = [k for row in keys for k in row]
    assert len(keys) >= 6 and len(set(drawn)) == len(drawn)
