"""vLLM's ``skip_special_tokens`` (the output text with or without special tokens, stop strings read in the same
text) and ``truncate_prompt_tokens`` (only the prompt's last k tokens), on the Python API; the server's are in
tests/test_server.py."""

from __future__ import annotations

import pytest

from spec_engine import LLM, SamplingParams, default_model_paths

TARGET, DRAFT = default_model_paths()
EOS = 0  # the default target's one special token, "<|endoftext|>"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm():
    return LLM(TARGET, speculative_config={"method": "hybrid", "model": DRAFT}, max_model_len=512)


def test_special_tokens_are_shown_when_asked(llm):
    """Tokens forced to the special one (allowed_token_ids, ignore_eos): no text by default, its name with
    skip_special_tokens=False; a stop string naming it is found only in the text that shows it."""
    assert llm.tokenizer.id_to_token(EOS) == "<|endoftext|>"
    forced = dict(max_tokens=3, ignore_eos=True, allowed_token_ids=[EOS])
    hidden = llm.generate(PROMPT, SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    shown = llm.generate(PROMPT, SamplingParams(**forced, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert hidden.token_ids == shown.token_ids == [EOS] * 3
    assert hidden.text == "" and shown.text == "<|endoftext|>" * 3
    stop = dict(forced, stop=["<|endoftext|>"])
    ignored = llm.generate(PROMPT, SamplingParams(**stop), use_tqdm=False)[0].outputs[0]
    stopped = llm.generate(PROMPT, SamplingParams(**stop, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 3
    assert stopped.finish_reason == "stop" and stopped.token_ids == [EOS] and stopped.text == ""


def test_a_truncated_prompt_is_its_last_tokens(llm):
    ids = llm.encode(PROMPT + "\n    # the n-th Fibonacci number, recursively\n")
    params = SamplingParams(max_tokens=16)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=16, truncate_prompt_tokens=5),
                       use_tqdm=False)[0]  # fmt: skip
    tail = llm.generate({"prompt_token_ids": ids[-5:]}, params, use_tqdm=False)[0]
    whole = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:] and out.outputs[0].token_ids == tail.outputs[0].token_ids
    assert whole.outputs[0].token_ids != tail.outputs[0].token_ids  # (the check can fail: the cut prompt matters)
    longer = SamplingParams(max_tokens=16, truncate_prompt_tokens=len(ids) + 10)
    assert llm.generate({"prompt_token_ids": ids}, longer, use_tqdm=False)[0].prompt_token_ids == ids


@pytest.mark.parametrize(
    "bad,match",
    [(dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be >= 1"),
     (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens must be"),
     (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens must be"),
     (dict(skip_special_tokens=0), "skip_special_tokens must be True or False")],
)  # fmt: skip
def test_bad_values_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
