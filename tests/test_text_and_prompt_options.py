"""vLLM's ``skip_special_tokens`` (the output text with or without special tokens, stop strings read in the same
text), ``truncate_prompt_tokens`` (only the prompt's last k tokens), ``bad_words`` (strings as token sequences) and
``guided_choice`` (the output one of some strings), on the Python API; the server's are in tests/test_server.py;
bad token sequences and choices against a by-hand reference (and a choice's exact distribution) in
tests/test_logits_processors.py."""

from __future__ import annotations

import pytest

from spec_engine import LLM, SamplingParams, default_model_paths
from spec_engine.sampling import with_token_ids

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


def test_a_stop_tokens_text_is_left_out_unless_asked(llm):
    """vLLM's: the token that ends a request (EOS, stop_token_ids) is in token_ids, its text only with
    include_stop_str_in_output; so a guided choice shows special tokens and still reads as the choice."""
    free = llm.generate(PROMPT, SamplingParams(max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    params = SamplingParams(max_tokens=12, stop_token_ids=[stop])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.text == llm.decode(free.token_ids[:first])
    params.include_stop_str_in_output = True
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text == llm.decode(free.token_ids[: first + 1])
    choices = ["positive", "negative"]
    shown = SamplingParams(max_tokens=8, guided_choice=choices, skip_special_tokens=False)
    assert llm.generate("Review: I loved it. Sentiment:", shown, use_tqdm=False)[0].outputs[0].text in choices


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


def test_bad_words_are_kept_out_of_the_output(llm):
    """Two words of plain decoding's output banned: their token sequences (as written, and after a space) never
    appear in the output, which differs; the engine alone (no tokenizer at hand) refuses strings without ids."""
    prompt = "import os\n\n"  # (the default prompt's answer is a loop of punctuation)
    free = llm.generate(prompt, SamplingParams(max_tokens=48), use_tqdm=False)[0].outputs[0]
    words = [w for w in free.text.split() if w.isalpha() and len(w) > 2][:2]
    assert len(words) == 2, free.text
    params = SamplingParams(max_tokens=48, bad_words=words)
    seqs = with_token_ids(params, llm.encode_words).bad_words_token_ids
    assert all(llm.encode_words(t) in seqs for w in words for t in (w, " " + w))
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids != free.token_ids
    assert all(out.token_ids[i : i + len(s)] != s for s in seqs for i in range(len(out.token_ids)))
    with pytest.raises(ValueError, match="bad_words need their token ids"):
        llm.engine.add_request(llm.encode(prompt), params)


def test_guided_choice_answers_with_one_of_the_strings(llm):
    """The output's text is one of the choices, ended by EOS (finish reason "stop"); greedy picks the same one with
    and without speculation; choices the tokenizer splits differently still work (token sequences of their own)."""
    choices = ["positive", "negative", "a neutral review", "(none)"]
    params = SamplingParams(max_tokens=16, guided_choice=choices)
    plain = LLM(TARGET, max_model_len=512)
    for prompt in ("Review: I loved it. Sentiment:", "import os\n\n"):
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert got.text in choices and got.finish_reason == "stop", got
        assert got.token_ids == plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="guided_choice with ignore_eos"):
        SamplingParams(guided_choice=["a"], ignore_eos=True)


def test_strings_need_a_tokenizer(tmp_path):
    """A model without a tokenizer takes token sequences, and says so for strings."""
    from tiny_models import make_model

    bare = LLM(str(make_model(tmp_path / "bare", "llama_gqa")), max_model_len=128)
    for params in (SamplingParams(guided_choice=["a"]), SamplingParams(bad_words=["a"])):
        with pytest.raises(ValueError, match="has no tokenizer: give bad_words_token_ids / guided_choice_token_ids"):
            bare.generate({"prompt_token_ids": [1, 2]}, params, use_tqdm=False)
    ids = SamplingParams(max_tokens=4, guided_choice_token_ids=[[3, 4]], stop_token_ids=[5])
    assert bare.generate({"prompt_token_ids": [1, 2]}, ids, use_tqdm=False)[0].outputs[0].token_ids == [3, 4, 5]


@pytest.mark.parametrize(
    "bad,match",
    [(dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be >= 1"),
     (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens must be"),
     (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens must be"),
     (dict(skip_special_tokens=0), "skip_special_tokens must be True or False"),
     (dict(bad_words=["ok", " "]), "bad_words must be a list"),
     (dict(bad_words="word"), "bad_words must be a list"),
     (dict(bad_words_token_ids=[[1], []]), "bad_words_token_ids must be"),
     (dict(bad_words_token_ids=[[1, -2]]), "bad_words_token_ids must be"),
     (dict(guided_choice=[]), "guided_choice must be"),
     (dict(guided_choice=["ok", ""]), "guided_choice must be"),
     (dict(guided_choice_token_ids=[[]]), "guided_choice_token_ids must be"),
     (dict(guided_choice=["a"], min_tokens=1), "guided_choice with min_tokens"),
     (dict(bad_words=["a"], allowed_token_ids=[1, 2]), "bad_words with allowed_token_ids")],
)  # fmt: skip
def test_bad_values_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


@pytest.mark.parametrize("spec", [None, {"method": "hybrid", "model": DRAFT}, {"method": "ngram"}])
def test_stop_strings_count_from_min_tokens(spec):
    """A stop string that ends at a token before ``min_tokens`` counts for nothing, then or later (vLLM's); the
    first that ends at the minimum or past it ends the request there, its text cut before it: a by-hand reference
    on plain decoding's tokens, the same with speculation, through the server's streamed text too."""
    import asyncio

    from spec_engine.server.async_engine import AsyncEngine

    llm = LLM(TARGET, speculative_config=spec, max_model_len=512)
    free = llm.generate(PROMPT, SamplingParams(max_tokens=48, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ids, text = free.token_ids, free.text
    stop = next(c for c in "(:,= ." if text.count(c) >= 2)
    first = next(k for k in range(1, len(ids) + 1) if stop in llm.decode(ids[:k]))  # the token completing it
    minimum = first + 2
    start = len(llm.decode(ids[: minimum - 1]))
    end = next(k for k in range(minimum, len(ids) + 1) if llm.decode(ids[:k]).find(stop, start) >= 0)
    want_text = llm.decode(ids[:end])
    want_text = want_text[: want_text.find(stop, start)]
    params = SamplingParams(max_tokens=48, ignore_eos=True, min_tokens=minimum, stop=[stop])
    got = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == ids[:end] and got.text == want_text and got.finish_reason == "stop"
    assert stop in got.text  # (the early one stays in the text)

    async def streamed() -> str:
        served = AsyncEngine(llm)
        try:
            pieces = [d.text async for d in await served.add_request(PROMPT, params)]
        finally:
            served.close()
        return "".join(pieces)

    assert asyncio.run(streamed()) == want_text


def test_a_text_prompt_dict_is_its_text(llm):
    """vLLM's TextPrompt ``{"prompt": text}`` is the text itself (was refused as neither a str nor token ids)."""
    params = SamplingParams(max_tokens=4)
    out = llm.generate([{"prompt": PROMPT}], params, use_tqdm=False)[0]
    plain = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert out.prompt == PROMPT and out.prompt_token_ids == plain.prompt_token_ids
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt must be"):
        llm.generate({"prompt": 5}, params, use_tqdm=False)
