"""Stop strings (OpenAI's ``stop``): the token whose text completes one is a request's last, its text ends before
the string, and a speculative step that emitted tokens past it keeps none of them, so every drafter gives what
decoding one token a step gives. Streams hold back a tail that may begin a stop string."""

from __future__ import annotations

import random

import pytest

from spec_engine import LLM, SamplingParams, default_model_paths
from spec_engine.sampling import stop_string_end, visible_text

TARGET, DRAFT = default_model_paths()
PROMPT = "def fibonacci(n):"
SPECS = {
    "plain": None,
    "draft model, depth 4": {"model": DRAFT, "num_speculative_tokens": 4},
    "draft model, adaptive": {"model": DRAFT},
    "suffix": {"method": "suffix"},
    "hybrid": {"method": "hybrid", "model": DRAFT},
}


def test_visible_text_cuts_at_the_first_stop_string_and_holds_back_a_partial_one():
    assert visible_text("a, b; c", None, finished=False) == "a, b; c"
    assert visible_text("a, b; c", [";", ","], finished=True) == "a"
    assert visible_text("a, b; c", ["b;"], finished=False) == "a, "
    assert visible_text("x = 1\nretu", ["return"], finished=False) == "x = 1\n"  # may yet become "return"
    assert visible_text("x = 1\nretu", ["return"], finished=True) == "x = 1\nretu"  # it ended without it
    assert visible_text("x = 1\nre", ["rex", "ret"], finished=False) == "x = 1\n"
    assert visible_text("abc", ["xyz"], finished=False) == "abc"
    # include_stop_str_in_output: cut after the first to start (the longest of those starting there)
    assert visible_text("a, b; c", [";", ","], finished=True, include_stop=True) == "a,"
    assert visible_text("a, b; c", [",", ", b"], finished=True, include_stop=True) == "a, b"
    assert visible_text("x = 1\nretu", ["return"], finished=False, include_stop=True) == "x = 1\n"


def _by_hand(stop: list[str], minimum: int, ids: list[int], decode) -> int | None:
    """The output length at which a stop string first counts: one token at a time, the text of the first
    ``minimum`` - 1 tokens excluded (a string must end past it)."""
    start = len(decode(ids[: minimum - 1])) if minimum > 1 else 0
    for k in range(max(1, minimum), len(ids) + 1):
        text = decode(ids[:k])
        if any(text.find(s, max(0, start - len(s) + 1)) >= 0 for s in stop):
            return k
    return None


def test_stop_string_end_matches_a_by_hand_reference_and_reads_a_bounded_tail():
    """Random streams of multi-character tokens, random calls of 1-5 tokens, with and without min_tokens: the
    token that completes a stop string is the by-hand reference's. Past the minimum, a call reads a tail of the
    output, not all of it (an output of n tokens was read whole per new token before: n^2)."""
    rng = random.Random(0)
    pieces = ["a", "b", "ab", "ba", "c", "", "bb"]  # "" a token of no text (a cut character, a special token)
    read = []

    def decode(ids, skip=True):
        read.append(len(ids))
        return "".join(pieces[i] for i in ids)

    for case in range(300):
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 60))]
        stop = [rng.choice(["ab", "bab", "cc", "abba", "c"]) for _ in range(rng.randrange(1, 3))]
        params = SamplingParams(max_tokens=64, stop=stop, min_tokens=rng.choice([0, 1, 2, 5, 20]))
        want = _by_hand(stop, params.min_tokens, ids, decode)
        got, n = None, 0
        while n < len(ids) and got is None:
            toks = ids[n : n + rng.randrange(1, 6)]
            end = stop_string_end(params, ids[:n], toks, decode)
            got = None if end is None else n + end
            n += len(toks)
        assert got == want, (case, ids, stop, params.min_tokens)
    read.clear()
    params = SamplingParams(max_tokens=4096, stop=["never"], min_tokens=3)
    for n in range(3000):
        stop_string_end(params, [1] * n, [1], decode)
    assert max(read) < 100


@pytest.fixture(scope="module")
def reference():
    """Plain decoding's 64 greedy tokens, and the stop string taken from the middle of their text (it begins inside
    a token and spans several)."""
    llm = LLM(TARGET, max_model_len=512)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)[0].outputs[0]
    stop = out.text[41:45]
    first = next(n for n in range(1, 65) if stop in llm.decode(out.token_ids[:n]))  # the token that completes it
    return out, stop, first


@pytest.mark.parametrize("name", list(SPECS))
def test_a_stop_string_ends_the_output_where_one_token_a_step_would(name, reference):
    full, stop, first = reference
    llm = LLM(TARGET, speculative_config=SPECS[name], max_model_len=512)
    params = SamplingParams(max_tokens=64, temperature=0.0, stop=["never in the output", stop])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:first]  # no token of a step past the one that completed the string
    assert out.text == full.text[: full.text.index(stop)]
    params.include_stop_str_in_output = True
    kept = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == out.token_ids and kept.text == full.text[: full.text.index(stop) + len(stop)]
    again = llm.generate(PROMPT, SamplingParams(max_tokens=64, temperature=0.0, stop=["never"]), use_tqdm=False)
    assert again[0].outputs[0].token_ids == full.token_ids and again[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("stop", [[""], "", [1], ("x",), ["x"] * 17, ["x" * 129]])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(ValueError, match="stop must be"):
        SamplingParams(stop=stop)


def test_one_stop_string_may_be_given_alone():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
