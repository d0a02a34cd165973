"""Greedy parity: every speculation mode emits exactly HF transformers' greedy tokens.

Positions where HF's top-2 logit margin is below 1e-3 are a coin toss between two float orders of summation, so each
comparison stops at the first such position.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import hf_trusted_greedy, make_model, make_noisy_copy

from spec_engine import LLM, SamplingParams

MAX_TOKENS = 24
PROMPTS = [[5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2], [77]]
MODES = {
    "none": None,
    "chain1": {"method": "draft_model", "num_speculative_tokens": 1},
    "chain5": {"method": "draft_model", "num_speculative_tokens": 5},
    "tree": {"method": "draft_model", "num_speculative_tokens": 3, "tree": [3, 2]},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
}


@pytest.fixture(scope="module", params=["llama_gqa", "llama3_rope", "qwen2_tied", "qwen3"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = make_model(root / "target", request.param, logit_scale=4.0)
    draft = make_noisy_copy(target, root / "draft", noise=0.3)
    return request.param, target, draft


@functools.cache
def hf_greedy(model_dir, prompt: tuple[int, ...], n: int) -> tuple[list[int], int]:
    from transformers import AutoModelForCausalLM

    return hf_trusted_greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), prompt, n)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(pair, mode):
    arch, target, draft = pair
    spec = MODES[mode] and dict(
        MODES[mode], **({"model": str(draft)} if MODES[mode]["method"] == "draft_model" else {})
    )
    llm = LLM(str(target), speculative_config=spec, max_model_len=128)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False
    )
    for prompt, out in zip(PROMPTS, outs):
        ref, trusted = hf_greedy(target, tuple(prompt), MAX_TOKENS)
        got = out.outputs[0].token_ids
        assert len(got) == MAX_TOKENS
        assert got[: trusted - 1] == ref[: trusted - 1], f"{arch}/{mode}: diverges from HF greedy"
        assert trusted > MAX_TOKENS // 2, "too many near-ties: the check would be vacuous"
    if mode in ("chain5", "tree"):
        # the noisy copy agrees often: speculation must really have accepted drafts
        assert sum(o.metrics["num_accepted"] for o in outs) > 0


def test_speculation_accepts_with_identical_draft(tmp_path):
    """Draft == target: every drafted token is accepted, so each step emits gamma + 1 tokens."""
    target = make_model(tmp_path / "t", "llama_gqa", logit_scale=4.0)
    llm = LLM(
        str(target), speculative_config={"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    )
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=16), use_tqdm=False)[0]
    assert out.metrics["acceptance_rate"] == 1.0
    assert out.metrics["num_steps"] == 4  # 16 tokens, 4 per step
    base = LLM(str(target)).generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=16), use_tqdm=False)
    assert out.outputs[0].token_ids == base[0].outputs[0].token_ids
