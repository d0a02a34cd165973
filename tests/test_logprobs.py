"""Log-probabilities (``SamplingParams.logprobs``): each emitted token's, and its k most likely alternatives', under the
target's distribution: HF transformers' log-softmax of the same positions' logits, with or without speculation,
greedy or sampled, alone or beside requests that ask for none."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import DRAFTER_MODES, drafter_config, make_model, make_noisy_copy

from spec_engine import LLM, SamplingParams

PROMPTS = [[5, 17, 3, 60, 42, 7, 5, 17, 3], [77]]
K = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    target = make_model(root / "target", "llama_gqa", logit_scale=4.0)
    return target, make_noisy_copy(target, root / "draft", noise=0.3)


def hf_logprobs(model_dir, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[n, V] HF's log-softmax at the positions that predict each output token (prompt + output in one pass)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()  # [P + n, V]
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)], dim=-1)


def assert_top_alternatives(entry: dict[int, float], ref: torch.Tensor, token: int, k: int) -> None:
    """``entry``'s alternatives (after the emitted ``token``) are HF's k most likely ids but ``token``, in its order.

    Two ids whose log-probabilities lie within 1e-4 may come in either order (and either may be the k-th): a near-tie
    goes either way between two float orders of summation. So the i-th alternative's HF value must be HF's i-th."""
    ours = list(entry)[1:]
    assert len(ours) in (k - 1, k) and token not in ours, entry
    expected = [i for i in ref.topk(k + 1).indices.tolist() if i != token][: len(ours)]
    assert torch.allclose(ref[ours], ref[expected], rtol=0, atol=1e-4), (entry, expected)


def check(model_dir, prompt: list[int], out, k: int) -> None:
    ref = hf_logprobs(model_dir, prompt, out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert next(iter(entry)) == token  # the emitted token first
        assert_top_alternatives(entry, ref[j], token, k)
        for i, value in entry.items():
            assert math.isclose(value, ref[j, i].item(), abs_tol=1e-4), (j, i, value, ref[j, i].item())


@pytest.mark.parametrize("mode", list(DRAFTER_MODES))
def test_logprobs_are_the_targets_with_any_drafter(pair, mode):
    target, draft = pair
    llm = LLM(str(target), speculative_config=drafter_config(mode, draft), max_model_len=128, dtype="float32")
    params = SamplingParams(max_tokens=16, logprobs=K)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        o = out.outputs[0]
        for token, entry in zip(o.token_ids, o.logprobs):  # greedy: the emitted token is the most likely one
            assert entry[token] == max(entry.values())
        check(target, prompt, o, K)
    if mode in ("chain4", "tree"):
        assert sum(o.metrics["num_accepted"] for o in outs) > 0  # the drafted steps' logprobs were checked too


def test_sampled_logprobs_and_neighbours_that_ask_for_none(pair):
    """Seeded sampled rows (the distribution before temperature) beside greedy rows with no logprobs, one batch: the
    logprobs rows are the target's, and every row's tokens are those the same batch gives with no logprobs asked
    (asking changes no token, though it moves the batch to the regular step)."""
    target, draft = pair
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft),
              "num_speculative_tokens": 3}, max_model_len=128, dtype="float32")  # fmt: skip
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=0)
    plain = SamplingParams(max_tokens=12)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts * 2, [sampled, sampled, plain, plain], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs[:2]):
        check(target, prompt, out.outputs[0], 1)
        assert all(len(e) == 1 for e in out.outputs[0].logprobs)  # logprobs=0: the token's alone
    assert all(out.outputs[0].logprobs is None for out in outs[2:])
    alone = llm.generate(prompts * 2, [SamplingParams(max_tokens=12, temperature=0.8, seed=3)] * 2 + [plain] * 2,
                         use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_logprobs_follow_the_tokens_cut_at_a_stop(pair):
    target, _ = pair
    llm = LLM(str(target), max_model_len=128, dtype="float32")
    full = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=16), use_tqdm=False)
    stop = full[0].outputs[0].token_ids[5]
    params = SamplingParams(max_tokens=16, logprobs=2, stop_token_ids=[stop])
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    check(target, PROMPTS[0], out, 2)


def test_a_planted_off_by_one_is_caught(pair, monkeypatch):
    """The check fails when each token's logprobs are read at the next node (its own position, not its parent's)."""
    import spec_engine.runner as runner

    target, _ = pair
    real = runner.step_logprobs

    def shifted(logits, result, num_accepted, k):
        return real(torch.roll(logits, -1, dims=1), result, num_accepted, k)

    monkeypatch.setattr(runner, "step_logprobs", shifted)
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(target),
              "num_speculative_tokens": 3}, max_model_len=128, dtype="float32")  # fmt: skip
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=12, logprobs=K), use_tqdm=False)
    with pytest.raises(AssertionError):
        check(target, PROMPTS[0], out[0].outputs[0], K)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_prompt_logprobs_are_hfs_across_prefill_chunks_and_skip_the_prefix_cache(pair):
    """``prompt_logprobs``: None for the first prompt token, then each one's under the target given those before it,
    over several prefill chunks; a request asking computes its prompt even where it is cached."""
    target, draft = pair
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft)}, max_model_len=128,
              dtype="float32", prefill_chunk=16, block_size=16)  # fmt: skip
    prompt = [(7 * i + 3) % 96 for i in range(41)]  # 40 prefilled positions: chunks of 16, 16 and 8
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2), use_tqdm=False)  # now cached
    params = SamplingParams(max_tokens=4, prompt_logprobs=3)
    out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": [9]}], params, use_tqdm=False)
    assert out[0].metrics["num_cached_tokens"] == 0 and out[0].outputs[0].logprobs is None
    again = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert again.metrics["num_cached_tokens"] == 32  # (it was cached: the request asking passed the cache by)
    assert out[1].prompt_logprobs == [None]  # a one-token prompt: nothing to predict
    got = out[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    ref = hf_logprobs(target, prompt[:1], prompt[1:])  # [40, V]: token j + 1 given tokens 0..j
    for j, entry in enumerate(got[1:]):
        assert next(iter(entry)) == prompt[j + 1]
        assert_top_alternatives(entry, ref[j], prompt[j + 1], 3)
        for i, value in entry.items():
            assert math.isclose(value, ref[j, i].item(), abs_tol=1e-4), (j, i)


def test_a_failed_prefill_chunk_run_again_scores_each_prompt_token_once(pair, monkeypatch):
    """A batched prefill chunk that fails for one row runs again row by row (the engine's isolation): the rows that
    had scored their chunk before the failure must not keep that chunk's prompt logprobs twice."""
    from spec_engine.runner import StepRunner

    target, _ = pair
    llm = LLM(str(target), max_model_len=128, dtype="float32", prefill_chunk=16, block_size=16)
    a = [(5 * i + 1) % 96 for i in range(40)]
    b = [95] + [(3 * i + 2) % 96 for i in range(39)]
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    alone = llm.generate({"prompt_token_ids": a}, params, use_tqdm=False)[0].prompt_logprobs
    real, failed = StepRunner._prompt_logprobs, []

    def once(self, req, hidden, n):  # b's second chunk fails the first time it is scored
        if req.prompt_token_ids[0] == 95 and req.cache_seqlen >= 16 and not failed:
            failed.append(True)
            raise RuntimeError("a planted failure")
        return real(self, req, hidden, n)

    monkeypatch.setattr(StepRunner, "_prompt_logprobs", once)
    outs = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], params, use_tqdm=False)
    assert failed and outs[0].prompt_logprobs == alone and len(outs[1].prompt_logprobs) == len(b)


def test_n_sequences_score_their_prompt_once(pair):
    """``prompt_logprobs`` with n = 3: the output's are the first sequence's; the other two take the prompt's K/V
    from the prefix cache instead of computing it again to score it."""
    target, _ = pair
    llm = LLM(str(target), max_model_len=128, dtype="float32", prefill_chunk=16, block_size=16)
    prompt = [(7 * i + 3) % 96 for i in range(41)]
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=2, n=3, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt)
    assert llm.engine.stats["num_cached_tokens"] == 2 * 32  # two followers, two full blocks each


def test_cumulative_logprob_sums_the_tokens_logprobs(pair):
    """vLLM's ``CompletionOutput.cumulative_logprob``: the sum of the emitted tokens' log-probabilities where logprobs
    are asked for (n sequences ranked by it), None where they are not."""
    llm = LLM(str(pair[0]), max_model_len=128, dtype="float32")
    seqs = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=6, logprobs=0, n=3, seed=1,
                        temperature=1.0), use_tqdm=False)[0].outputs  # fmt: skip
    for o in seqs:
        assert math.isclose(o.cumulative_logprob, sum(e[t] for t, e in zip(o.token_ids, o.logprobs)), abs_tol=1e-9)
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2),
                        use_tqdm=False)[0].outputs[0].cumulative_logprob is None  # fmt: skip


def test_a_requests_alternatives_do_not_depend_on_the_largest_k_of_its_batch():
    """A step reads every row's alternatives with the batch's largest k; a request keeps the first k of them. Ties
    (common in bf16 logits) go to the lower id, so those first k are the request's top k whatever the batch asks."""
    from spec_engine.logprobs import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(3, 500).to(torch.bfloat16).float()  # [N, V]
    logits[:, [400, 7, 100]] = logits.max() + 1  # a three-way tie at the top
    logits[1, [300, 5]] = logits[1].topk(6).values[-1]  # and one over the sixth to eighth places
    tokens = torch.tensor([7, 3, 100])
    widest = token_logprobs(logits, tokens, 20)
    for k in range(21):
        for row, wide in zip(token_logprobs(logits, tokens, k), widest):
            assert row.top_ids == wide.top_ids[:k] and row.top_logprobs == wide.top_logprobs[:k], k
            assert row.logprob == wide.logprob
    assert widest[0].top_ids[:3] == [7, 100, 400]  # the tie in id order
