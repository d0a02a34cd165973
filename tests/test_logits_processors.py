"""Logits processors (``spec_engine.logits_processors``: penalties, logit_bias, min_tokens): greedy tokens are a
step-by-step reference's (HF's forward, the processors applied by hand), with and without speculation, each tree node
processed under its own path; seeded samples are the same with any drafter; a planted bug (the drafted path ignored)
is caught."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from tiny_models import DRAFTER_MODES, drafter_config, make_model, make_noisy_copy

import spec_engine.logits_processors as processors
from spec_engine import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2]]
MAX_TOKENS = 20
SETTINGS = {
    "repetition": dict(repetition_penalty=1.5),
    "presence_frequency": dict(presence_penalty=0.8, frequency_penalty=0.6),
    "all": dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.2),
    # a bias on prompt tokens under a repetition penalty: (z + b) / r, vLLM's order, not z / r + b
    "bias_repetition": dict(repetition_penalty=1.6, logit_bias={5: 3.0, 17: -1.0, 60: 4.0, 3: 2.0}),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("processors")
    target = make_model(root / "target", "llama_gqa", logit_scale=4.0)
    return target, make_noisy_copy(target, root / "draft", noise=0.1)


def guided(z: torch.Tensor, out: list[int], choices: list[list[int]], stops) -> torch.Tensor:
    """``z`` [V] with only the choices' next tokens after ``out`` (and the stop tokens where it is one whole)."""
    n = len(out)
    keep = {c[n] for c in choices if len(c) > n and c[:n] == out} | (set(stops) if out in choices else set())
    masked = torch.full_like(z, float("-inf"))
    masked[sorted(keep)] = z[sorted(keep)]
    return masked


def reference_greedy(model_dir, prompt: list[int], n: int, presence_penalty=0.0, frequency_penalty=0.0,
                     repetition_penalty=1.0, logit_bias=None, min_tokens=0, stop_token_ids=(),
                     allowed_token_ids=None, bad_words_token_ids=(),
                     guided_choice_token_ids=None) -> tuple[list[int], int]:  # fmt: skip
    """Greedy tokens one forward a token with the processors applied by hand (up to and with the first stop token),
    and how many are trustworthy (the top-2 margin of the processed logits >= 1e-3: a near-tie may go either way in
    another order of summation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq, trusted = list(prompt), n
    for i in range(n):
        with torch.no_grad():
            z = model(torch.tensor([seq])).logits[0, -1].float()
        if guided_choice_token_ids:  # vLLM's order: a guided choice, allowed ids, bad words, min_tokens, the bias,
            z = guided(z, seq[len(prompt) :], guided_choice_token_ids, stop_token_ids)  # then the penalties
        if allowed_token_ids:
            banned = torch.ones_like(z, dtype=torch.bool)
            banned[allowed_token_ids] = False
            z[banned] = float("-inf")
        out = seq[len(prompt) :]
        for bad in bad_words_token_ids:  # the last token, where the output ends with the rest
            if len(bad) == 1 or len(out) >= len(bad) - 1 and out[len(out) - len(bad) + 1 :] == bad[:-1]:
                z[bad[-1]] = float("-inf")
        if len(seq) - len(prompt) < min_tokens:
            z[list(stop_token_ids)] = float("-inf")
        for x, v in (logit_bias or {}).items():
            z[x] += v
        for x in set(seq):
            z[x] = z[x] / repetition_penalty if z[x] > 0 else z[x] * repetition_penalty
        for x, c in Counter(seq[len(prompt) :]).items():
            z[x] -= frequency_penalty * c + presence_penalty
        top2 = z.topk(2).values
        if trusted == n and top2[0] - top2[1] < 1e-3:
            trusted = i + 1
        seq.append(int(z.argmax()))
        if seq[-1] in stop_token_ids:
            return seq[len(prompt) :], min(trusted, i + 1)
    return seq[len(prompt) :], trusted


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", list(DRAFTER_MODES))
def test_greedy_penalised_tokens_match_the_reference(pair, mode, setting):
    target, draft = pair
    llm = LLM(str(target), speculative_config=drafter_config(mode, draft), max_model_len=128, dtype="float32")
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


@pytest.mark.parametrize("mode", list(DRAFTER_MODES))
def test_logit_bias_and_min_tokens_match_the_reference(pair, mode):
    """A bias that bans the first greedy token and favours another; then the biased output's third token as a stop
    token, held back for 8 tokens (each drafted node by its own depth)."""
    target, draft = pair
    llm = LLM(str(target), speculative_config=drafter_config(mode, draft), max_model_len=128, dtype="float32")
    prompt = {"prompt_token_ids": PROMPTS[0]}

    def greedy(**kw) -> list[int]:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    distinct = list(dict.fromkeys(greedy()))  # the unprocessed output's tokens, first seen first
    bias = {distinct[0]: -100.0, distinct[1]: 2.0}
    biased = greedy(logit_bias=bias)
    assert distinct[0] not in biased and biased != greedy()[: len(biased)]
    kw = dict(logit_bias=bias, min_tokens=8, stop_token_ids=[biased[2]])
    got = greedy(**kw)
    ref, trusted = reference_greedy(target, PROMPTS[0], MAX_TOKENS, **kw)
    assert trusted >= 8, "too many near-ties: the check would be vacuous"
    assert got[:trusted] == ref[:trusted], (mode, got, ref)
    assert len(got) > 8 and biased[2] not in got[:8]  # held back, where it would have ended the request at 3


@pytest.mark.parametrize("mode", list(DRAFTER_MODES))
def test_allowed_token_ids_match_the_reference(pair, mode):
    target, draft = pair
    llm = LLM(str(target), speculative_config=drafter_config(mode, draft), max_model_len=128, dtype="float32")
    prompt = {"prompt_token_ids": PROMPTS[1]}
    free = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0].token_ids
    allowed = [t for t in range(96) if t not in free[:3]][:40]  # the first tokens plain decoding emits, left out
    got = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, allowed_token_ids=allowed),
                       use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    ref, trusted = reference_greedy(target, PROMPTS[1], MAX_TOKENS, allowed_token_ids=allowed)
    assert trusted > MAX_TOKENS // 2 and got[:trusted] == ref[:trusted] and set(got) <= set(allowed)


@pytest.mark.parametrize("mode", list(DRAFTER_MODES))
def test_bad_words_match_the_reference(pair, mode):
    """Token sequences banned (bad_words_token_ids): two-token ones taken from plain decoding's output, so that they
    bite where drafts would propose them, and a one-token one; each drafted node judged under its own path."""
    target, draft = pair
    llm = LLM(str(target), speculative_config=drafter_config(mode, draft), max_model_len=128, dtype="float32")
    prompt = {"prompt_token_ids": PROMPTS[0]}
    free = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0].token_ids
    bad = [free[2:4], free[8:11], [free[14]]]
    got = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, bad_words_token_ids=bad),
                       use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    ref, trusted = reference_greedy(target, PROMPTS[0], MAX_TOKENS, bad_words_token_ids=bad)
    assert trusted > MAX_TOKENS // 2 and got[:trusted] == ref[:trusted], (mode, got, ref)
    assert got != free  # the bans bite
    assert all(got[i : i + len(b)] != b for b in bad for i in range(len(got)))


def _choices(llm) -> tuple[list[list[int]], int]:
    """Three choices that share first tokens with plain decoding's output (drafts propose into them) and a stop."""
    free = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=MAX_TOKENS),
                        use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    stop = next(t for t in range(96) if t not in free)
    choices = [free[:4], free[:2] + [free[5], free[6]], [free[3], free[1]]]
    assert len({tuple(c) for c in choices}) == 3, free  # (distinct, so that each has its own probability)
    return choices, stop


@pytest.mark.parametrize("mode", list(DRAFTER_MODES))
def test_guided_choice_matches_the_reference(pair, mode):
    """Greedy rows pick the choice one token at a time by the masked argmax, then the stop token."""
    target, draft = pair
    llm = LLM(str(target), speculative_config=drafter_config(mode, draft), max_model_len=128, dtype="float32")
    choices, stop = _choices(llm)
    params = SamplingParams(max_tokens=MAX_TOKENS, guided_choice_token_ids=choices, stop_token_ids=[stop])
    got = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0].outputs[0]
    ref, trusted = reference_greedy(target, PROMPTS[0], MAX_TOKENS, guided_choice_token_ids=choices,
                                    stop_token_ids=[stop])  # fmt: skip
    assert got.token_ids == ref and trusted == len(ref) and got.finish_reason == "stop"
    assert got.token_ids[:-1] in choices and got.token_ids[-1] == stop


def test_guided_choice_samples_follow_the_exact_distribution(pair):
    """Sampled rows (temperature 1, a draft model at depth 3) pick each choice with its exact probability under
    the masked target: the product of its tokens' masked softmax (chi2 over 600 seeded requests). (Masking each
    drafted node as if its path were not there, a planted bug, emits tokens off every choice: caught here.)"""
    from test_engine_sampling import chi2_pvalue
    from transformers import AutoModelForCausalLM

    target, draft = pair
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft),
              "num_speculative_tokens": 3}, max_model_len=128, dtype="float32", max_num_seqs=64)  # fmt: skip
    choices, stop = _choices(llm)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    probs = []
    for c in choices:
        p = 1.0
        for j in range(len(c) + 1):
            with torch.no_grad():
                z = model(torch.tensor([PROMPTS[0] + c[:j]])).logits[0, -1]
            p *= torch.softmax(guided(z, c[:j], choices, [stop]), dim=-1)[c[j] if j < len(c) else stop].item()
        probs.append(p)
    assert abs(sum(probs) - 1) < 1e-9
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, guided_choice_token_ids=choices,
                             stop_token_ids=[stop]) for s in range(600)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 600, params, use_tqdm=False)
    counts = np.zeros(len(choices))
    for o in outs:
        assert o.outputs[0].token_ids[:-1] in choices and o.outputs[0].token_ids[-1] == stop, o.outputs[0].token_ids
        counts[choices.index(o.outputs[0].token_ids[:-1])] += 1
    assert min(probs) > 0.02 and chi2_pvalue(counts, np.array(probs)) > 1e-3, (counts, probs)
    assert llm.engine.stats["num_accepted"] > 0


def test_seeded_penalised_samples_are_the_same_with_any_drafter(pair):
    target, draft = pair
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=5, **SETTINGS["all"])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = {}
    for mode in DRAFTER_MODES:
        llm = LLM(str(target), speculative_config=drafter_config(mode, draft), max_model_len=128, dtype="float32")
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(got == outs["none"] for got in outs.values()), outs
    free = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=5)  # (the processors bite on sampled rows)
    assert outs["none"] != [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]


def test_a_planted_bug_is_caught(pair, monkeypatch):
    """Penalising every node as if its drafted path were not there (the root's context for all) changes a
    speculative request's greedy tokens: the reference check above would fail."""
    target, _ = pair
    monkeypatch.setattr(processors, "node_paths", lambda parents: [[] for _ in parents])
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(target),
              "num_speculative_tokens": 4}, max_model_len=128, dtype="float32")  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, **SETTINGS["presence_frequency"])
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    wrong = 0
    for prompt, o in zip(PROMPTS, out):
        ref, trusted = reference_greedy(target, prompt, MAX_TOKENS, **SETTINGS["presence_frequency"])
        wrong += o.outputs[0].token_ids[:trusted] != ref[:trusted]
    assert wrong > 0


def test_a_planted_bad_words_bug_is_caught(pair, monkeypatch):
    """Banning as if no drafted token preceded a node lets a draft that agrees with the target complete a banned
    sequence inside one step."""
    target, _ = pair
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4}
    llm = LLM(str(target), speculative_config=spec, max_model_len=128, dtype="float32")
    prompt = {"prompt_token_ids": PROMPTS[0]}
    free = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0].token_ids
    bad = [free[i : i + 2] for i in range(2, MAX_TOKENS - 2, 3)]
    params = SamplingParams(max_tokens=MAX_TOKENS, bad_words_token_ids=bad)
    ok = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(processors, "node_paths", lambda parents: [[] for _ in parents])
    planted = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    contains = [any(out[i : i + 2] == b for b in bad for i in range(len(out))) for out in (ok, planted)]
    assert contains == [False, True]


def test_bad_words_reach_back_over_a_short_output():
    """An output shorter than the longest banned sequence: the shorter ones still match against the whole of it (a
    negative slice start once kept only its tail)."""
    z = torch.zeros(1, 12)
    processors._ban_bad_words(z, np.array([9, 9, 1, 2, 3]), [[]], [[1, 2, 3, 4], [7] * 8])
    assert z[0, 4] == float("-inf") and z[0, 7] == 0


def test_node_paths():
    # root 0; 1, 2 its children; 3 under 1; 4 under 3; 5 padding
    assert processors.node_paths([-1, 0, 0, 1, 3, -1]) == [[], [1], [2], [1, 3], [1, 3, 4], []]


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


@pytest.mark.parametrize(
    "bad",
    [
        dict(logit_bias={1: 101}),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={"1": 1.0}),
        dict(logit_bias=[1]),
        dict(logit_bias={i: 1.0 for i in range(301)}),
        dict(min_tokens=-1),
        dict(min_tokens=65, max_tokens=64),
        dict(min_tokens=1.0),
        dict(allowed_token_ids=[]),
        dict(allowed_token_ids=[-1]),
        dict(allowed_token_ids=(1,)),
        dict(stop_token_ids=[-22]),  # (a negative id would index from the end of the vocabulary)
    ],  # fmt: skip
)
def test_bad_bias_and_min_tokens_are_refused(bad):
    with pytest.raises(ValueError, match="logit_bias|min_tokens|allowed_token_ids|stop_token_ids"):
        SamplingParams(**bad)


def test_a_bias_past_the_vocabulary_is_refused_before_queueing(pair):
    llm = LLM(str(pair[0]), max_model_len=128, dtype="float32")
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    # allowed tokens that min_tokens all holds back: nothing could be emitted
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(allowed_token_ids=[9], stop_token_ids=[9],
                     min_tokens=5), use_tqdm=False)  # fmt: skip
    # stop ids past the vocabulary (never emitted) held back by min_tokens: as if absent
    params = SamplingParams(max_tokens=8, min_tokens=4, ignore_eos=True, stop_token_ids=[10**6, 2**70])
    out = llm.generate({"prompt_token_ids": [1, 2]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=8, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
