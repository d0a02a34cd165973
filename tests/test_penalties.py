"""Repetition, presence and frequency penalties (``spec_engine.penalties``): greedy tokens are a step-by-step
reference's (HF's forward, the penalties applied by hand), with and without speculation, each tree node penalised
under its own path; seeded samples are the same with any drafter; a planted bug (the drafted path ignored) is caught."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_models import make_model, make_noisy_copy

import spec_engine.penalties as penalties
from spec_engine import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2]]
MAX_TOKENS = 20
SETTINGS = {
    "repetition": dict(repetition_penalty=1.5),
    "presence_frequency": dict(presence_penalty=0.8, frequency_penalty=0.6),
    "all": dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.2),
}
MODES = {
    "none": None,
    "chain4": {"method": "draft_model", "num_speculative_tokens": 4},
    "tree": {"method": "draft_model", "num_speculative_tokens": 3, "tree": [2, 2, 1]},
    "adaptive": {"method": "draft_model"},
    "suffix": {"method": "suffix"},
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("penalties")
    target = make_model(root / "target", "llama_gqa", logit_scale=4.0)
    return target, make_noisy_copy(target, root / "draft", noise=0.1)


def reference_greedy(model_dir, prompt: list[int], n: int, presence_penalty=0.0, frequency_penalty=0.0,
                     repetition_penalty=1.0) -> tuple[list[int], int]:  # fmt: skip
    """Greedy tokens one forward a token with the penalties applied by hand, and how many are trustworthy (the top-2
    margin of the penalised logits >= 1e-3: a near-tie may go either way in another order of summation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq, trusted = list(prompt), n
    for i in range(n):
        with torch.no_grad():
            z = model(torch.tensor([seq])).logits[0, -1].float()
        for x in set(seq):
            z[x] = z[x] / repetition_penalty if z[x] > 0 else z[x] * repetition_penalty
        for x, c in Counter(seq[len(prompt) :]).items():
            z[x] -= frequency_penalty * c + presence_penalty
        top2 = z.topk(2).values
        if trusted == n and top2[0] - top2[1] < 1e-3:
            trusted = i + 1
        seq.append(int(z.argmax()))
    return seq[len(prompt) :], trusted


def spec_config(mode: str, draft) -> dict | None:
    spec = MODES[mode]
    return spec and dict(spec, **({"model": str(draft)} if spec["method"] == "draft_model" else {}))


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_penalised_tokens_match_the_reference(pair, mode, setting):
    target, draft = pair
    llm = LLM(str(target), speculative_config=spec_config(mode, draft), max_model_len=128, dtype="float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, **SETTINGS[setting])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, trusted = reference_greedy(target, prompt, MAX_TOKENS, **SETTINGS[setting])
        assert trusted > MAX_TOKENS // 2, "too many near-ties: the check would be vacuous"
        assert out.outputs[0].token_ids[:trusted] == ref[:trusted], (mode, setting)
    unpenalised = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=MAX_TOKENS),
                               use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in unpenalised]  # they bite
    if mode in ("chain4", "tree"):
        assert sum(o.metrics["num_accepted"] for o in outs) > 0  # drafted nodes were judged penalised


def test_seeded_penalised_samples_are_the_same_with_any_drafter(pair):
    target, draft = pair
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=5, **SETTINGS["all"])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = {}
    for mode in MODES:
        llm = LLM(str(target), speculative_config=spec_config(mode, draft), max_model_len=128, dtype="float32")
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(got == outs["none"] for got in outs.values()), outs


def test_a_planted_bug_is_caught(pair, monkeypatch):
    """Penalising every node as if its drafted path were not there (the root's context for all) changes a
    speculative request's greedy tokens: the reference check above would fail."""
    target, _ = pair
    monkeypatch.setattr(penalties, "node_paths", lambda parents: [[] for _ in parents])
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(target),
              "num_speculative_tokens": 4}, max_model_len=128, dtype="float32")  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, **SETTINGS["presence_frequency"])
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    wrong = 0
    for prompt, o in zip(PROMPTS, out):
        ref, trusted = reference_greedy(target, prompt, MAX_TOKENS, **SETTINGS["presence_frequency"])
        wrong += o.outputs[0].token_ids[:trusted] != ref[:trusted]
    assert wrong > 0


def test_node_paths():
    # root 0; 1, 2 its children; 3 under 1; 4 under 3; 5 padding
    assert penalties.node_paths([-1, 0, 0, 1, 3, -1]) == [[], [1], [2], [1, 3], [1, 3, 4], []]


@pytest.mark.parametrize(
    "bad",
    [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(frequency_penalty=float("nan")),
        dict(repetition_penalty=0),
        dict(repetition_penalty=-1.0),
        dict(repetition_penalty=1e9),
        dict(presence_penalty="0.5"),
        dict(repetition_penalty=True),
    ],  # fmt: skip
)
def test_bad_penalties_are_refused(bad):
    with pytest.raises(ValueError, match="penalty"):
        SamplingParams(**bad)
