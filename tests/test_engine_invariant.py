"""Seeded sampling is drafter-invariant: a seeded request's tokens are the same with no speculation, with draft
chains at every depth, static trees, n-gram drafts and adaptive speculation, alone or inside a batch of 16.

The position-keyed Gumbel coupling (spec_engine/coupling.py) makes each token argmax(log p~_t + g_t), with noise
g_t a function of (seed, position) only; verification of a coupled row is greedy on the perturbed logits, so what was
drafted changes only how many tokens one target pass emits. Losslessness (the coupled tokens follow the target's
exact distribution) is tested by chi2 in test_engine_sampling.py.
"""

from __future__ import annotations

import pytest
from tiny_models import make_model, make_noisy_copy

from spec_engine import LLM, SamplingParams

PROMPT = [5, 17, 3, 60, 42, 7, 5, 17, 3]
OTHERS = [[1, 2, 3, 4, 1, 2], [77], [9] * 20, [30, 31], [4, 8, 15, 16, 23, 42], list(range(40, 75)), [2, 90, 2, 90]]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, seed=12345, ignore_eos=True),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariant")
    target = make_model(root / "target", "llama_gqa", layers=2, logit_scale=3.0)
    return {"target": target, "draft": make_noisy_copy(target, root / "draft", noise=0.02)}


def _tokens(llm: LLM, params: SamplingParams, others: int = 0) -> list[int]:
    """The seeded request's tokens, alone or after ``others`` other requests (seeded and not, greedy and sampled)."""
    prompts = [{"prompt_token_ids": p} for p in (OTHERS * 3)[:others]] + [{"prompt_token_ids": PROMPT}]
    extra = [SamplingParams(max_tokens=12 + i, temperature=(0.0, 0.7, 1.2)[i % 3], seed=i if i % 2 else None,
                            ignore_eos=True) for i in range(others)]  # fmt: skip
    outs = llm.generate(prompts, extra + [params], use_tqdm=False)
    return outs[-1].outputs[0].token_ids


def _llm(models, spec) -> LLM:
    if spec is not None and spec.get("method", "draft_model") == "draft_model":
        spec = {"method": "draft_model", "model": str(models["draft"]), **spec}
    return LLM(str(models["target"]), speculative_config=spec, max_model_len=128, max_num_seqs=16)


CONFIGS = {
    **{f"chain{g}": {"num_speculative_tokens": g} for g in range(1, 9)},
    "tree[2,2,1]": {"num_speculative_tokens": 3, "tree": [2, 2, 1]},
    "tree[3,2]-iid": {"num_speculative_tokens": 2, "tree": [3, 2], "draft_sampling": "iid"},
    "tree[2,2]-deterministic": {"num_speculative_tokens": 2, "tree": [2, 2], "draft_sampling": "deterministic"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "adaptive": {},
}


@pytest.fixture(scope="module")
def plain(models):
    llm = _llm(models, None)
    return [_tokens(llm, p) for p in PARAMS]


def test_plain_is_batch_invariant(models, plain):
    llm = _llm(models, None)
    assert [_tokens(llm, p, others=15) for p in PARAMS] == plain


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculation_gives_the_plain_tokens(models, plain, name):
    llm = _llm(models, CONFIGS[name])
    assert [_tokens(llm, p) for p in PARAMS] == plain
    if name != "ngram":
        assert llm.engine.stats["num_accepted"] > 0  # the drafts were used, not bypassed
    assert [_tokens(llm, PARAMS[1], others=15)] == plain[1:]


def test_invariant_off_is_rejection_sampling(models, plain):
    """invariant=False keeps rejection sampling: still seeded and reproducible at a fixed config, but not the
    coupled tokens (a different sampler, so almost surely different over 24 tokens)."""
    llm = _llm(models, {"num_speculative_tokens": 3})
    off = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True, invariant=False)
    first = _tokens(llm, off)
    assert _tokens(llm, off) == first and first != plain[0]


def test_unseeded_invariant_requests_agree_with_themselves(models):
    """invariant=True without a seed: coupled on the engine's own random seed, so two such requests differ."""
    llm = _llm(models, {"num_speculative_tokens": 3})
    p = SamplingParams(max_tokens=24, temperature=1.0, invariant=True, ignore_eos=True)
    assert _tokens(llm, p) != _tokens(llm, p)
