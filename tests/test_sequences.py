"""n sequences a prompt (vLLM's ``SamplingParams.n``): ``LLM.generate`` runs each as its own request and returns them
as one output's ``outputs``. A seeded request's first sequence is the same request with n = 1, the others are
distinct and reproducible, and the prompt's K/V is computed once (prefix caching holds the others a step)."""

from __future__ import annotations

import random

import pytest

from spec_engine import LLM, SamplingParams, default_model_paths
from spec_engine.sampling import sequence_params

TARGET, DRAFT = default_model_paths()
PROMPT = [random.Random(1).randrange(3, 2000) for _ in range(100)]  # 3 full blocks of 32 before the last token


@pytest.fixture(scope="module")
def llm():
    return LLM(TARGET, speculative_config={"model": DRAFT}, max_model_len=256)


def _tokens(out) -> list[list[int]]:
    return [o.token_ids for o in out.outputs]


def test_seeded_sequences_are_distinct_reproducible_and_the_first_is_n_1(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=4)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    tokens = _tokens(out)
    assert len({tuple(t) for t in tokens}) == 4
    alone = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=16, temperature=1.0, seed=7), use_tqdm=False
    )
    assert tokens[0] == alone[0].outputs[0].token_ids
    assert _tokens(llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]) == tokens
    # sequence i is the request with sequence_params(params, i): what a caller could run one by one
    third = llm.generate({"prompt_token_ids": PROMPT}, sequence_params(params, 2), use_tqdm=False)[0]
    assert third.outputs[0].token_ids == tokens[2]


def test_greedy_sequences_share_the_prompt_and_agree():
    llm = LLM(TARGET, max_model_len=256)  # a fresh cache: the prompt is computed once, by the first sequence
    out = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=12, temperature=0.0, n=3), use_tqdm=False
    )[0]
    assert _tokens(out)[1:] == [_tokens(out)[0]] * 2
    assert llm.engine.stats["num_cached_tokens"] == 2 * 3 * 32


def test_several_prompts_with_their_own_n(llm):
    params = [SamplingParams(max_tokens=8, temperature=0.0, n=2), SamplingParams(max_tokens=8, temperature=0.0)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:50]}], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 1]


@pytest.mark.parametrize("n", [0, -1, 65, 1.5, True])
def test_bad_n_is_refused(n):
    with pytest.raises(ValueError, match="n"):
        SamplingParams(n=n)


def test_the_engine_takes_one_sequence_a_request(llm):
    with pytest.raises(ValueError, match="one sequence a request"):
        llm.engine.add_request(PROMPT, SamplingParams(n=2))
