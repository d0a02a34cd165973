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


def _found_in_calls(params: SamplingParams, ids: list[int], decode, rng: random.Random, prompt=()) -> int | None:
    """The output length at which ``stop_string_end`` ends ``ids``, fed in calls of 1-5 tokens as the engine's steps
    emit them (None: never)."""
    got, n = None, 0
    while n < len(ids) and got is None:
        toks = ids[n : n + rng.randrange(1, 6)]
        end = stop_string_end(params, ids[:n], toks, decode, prompt)
        got = None if end is None else n + end
        n += len(toks)
    return got


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
        got = _found_in_calls(params, ids, decode, rng)
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


def test_streamed_text_is_decoded_incrementally_and_equals_the_whole_decode(tmp_path):
    """The server's deltas (``AsyncEngine._new_text``): random byte-level token streams (characters cut across
    tokens, U+FFFD included), random steps of 1-5 tokens, with and without stop strings and min_tokens. Joined they
    are the whole output's text as ``visible_text`` shows it; no delta ends in a cut character but at the end; and
    each step decodes a window of its new tokens, not the whole output."""
    from types import SimpleNamespace

    from tiny_models import make_tokenizer

    from spec_engine.server.async_engine import REPLACEMENT_CHAR, AsyncEngine, _Sink

    tok = make_tokenizer(tmp_path / "tok", corpus=["naïve café 日本語 déjà vu — ünïcödé ✓ 🙂 " * 4, "plain text"])
    widths = []

    def decode(ids, skip=True):
        widths.append(len(ids))
        return tok.decode(list(ids), skip_special_tokens=skip)

    fake = SimpleNamespace(llm=SimpleNamespace(tokenizer=tok, decode=decode))
    rng = random.Random(0)
    for case in range(60):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 120))]
        stop = ["é", "ab"] if case % 3 == 0 else None
        params = SamplingParams(max_tokens=200, stop=stop, min_tokens=rng.choice([0, 5]) if stop else 0)
        sink, sent, n = _Sink(None, None, 0), [], 0
        while n < len(ids):
            n = min(len(ids), n + rng.randrange(1, 6))
            done = n == len(ids)
            sent.append(AsyncEngine._new_text(fake, sink, ids[:n], done, params))
            assert done or stop or not sent[-1].endswith(REPLACEMENT_CHAR)  # (a stop string may cut after one)
        whole = tok.decode(ids)
        start = len(tok.decode(ids[: params.min_tokens - 1])) if stop and params.min_tokens > 1 else 0
        assert "".join(sent) == visible_text(whole, stop, True, start=start), case
    widths.clear()
    sink, ids = _Sink(None, None, 0), [rng.randrange(tok.get_vocab_size()) for _ in range(2000)]
    for n in range(1, len(ids) + 1):
        AsyncEngine._new_text(fake, sink, ids[:n], n == len(ids), SamplingParams(max_tokens=2000))
    assert max(widths) < 50  # (the whole output per step before: 2000)


def test_a_decoder_that_reads_a_window_otherwise_falls_back_to_the_whole_output():
    """A decoder whose text of a window is not a prefix of the text of a longer one (here token 0 alone reads
    "*b"): the step decodes from the output's start instead, and the deltas still join to the whole text."""
    from types import SimpleNamespace

    from spec_engine.server.async_engine import AsyncEngine, _Sink

    def decode(ids, skip=True):
        return "*b" if list(ids) == [0] else "".join("bacd"[i] for i in ids)

    fake = SimpleNamespace(llm=SimpleNamespace(tokenizer=object(), decode=decode))
    sink, ids = _Sink(None, None, 0), [1, 0, 2, 3]
    deltas = [AsyncEngine._new_text(fake, sink, ids[:n], n == len(ids), SamplingParams()) for n in range(1, 5)]
    assert "".join(deltas) == "abcd" and deltas == ["a", "b", "c", "d"]


def _sentencepiece_tokenizer(decoder: str):
    """A Llama-2 / Mistral style tokenizer (words are "\u2581"-prefixed pieces, "<0xNN>" pieces bytes, "</s>"
    special) whose decoder drops the space before the first word of what it decodes: ``decoder`` "metaspace" (a
    Metaspace decoder) or "llama" (Llama-2's tokenizer.json: Replace, ByteFallback, Fuse, Strip)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "</s>", "\u2581Say", "\u2581Hello", "\u2581world", "\u2581x", "\u2581", "ello", "!", ","]
    words += ["<0xE2>", "<0x82>", "<0xAC>"]  # the bytes of "€"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = {
        "metaspace": decoders.Metaspace(prepend_scheme="first"),
        "llama": decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        ),
    }[decoder]
    return tok


@pytest.mark.parametrize("decoder", ["metaspace", "llama"])
def test_a_sentencepiece_output_reads_after_its_prompt(decoder):
    """Random prompts and outputs of a SentencePiece-style tokenizer: the output's text is the whole sequence's less
    the prompt's (decoded alone, the output's first word lost its space: "Hello", not " Hello"); a stop string with a
    leading space is found at the output's very start (``stop_string_end``, against the by-hand reference on that
    text; so is a ByteFallback character that a call's later bytes turn into U+FFFD); and the server's deltas join to
    that text as ``visible_text`` shows it."""
    from types import SimpleNamespace

    from spec_engine.sampling import output_text
    from spec_engine.server.async_engine import AsyncEngine, _Sink

    tok = _sentencepiece_tokenizer(decoder)
    assert tok.decode([2, 3]) == "Say Hello" and tok.decode([3]) == "Hello"

    def decode(ids, skip=True):
        return tok.decode(list(ids), skip_special_tokens=skip)

    fake = SimpleNamespace(llm=SimpleNamespace(tokenizer=tok, decode=decode))
    assert output_text(decode, [2], [3, 4], True) == " Hello world"
    assert stop_string_end(SamplingParams(stop=[" Hello"]), [], [3, 4], decode, [2]) == 1
    if decoder == "llama":  # "€" complete at the call's first token, read as U+FFFD again with its second
        assert decode([10, 11, 12]) == "\u20ac" and decode([10, 11, 12, 10]) == "\ufffd" * 4
        assert stop_string_end(SamplingParams(stop=["\u20ac"]), [10, 11], [12, 10], decode, [2]) == 1
    # an output's units: "</s>", a word or a piece, the three bytes of "€", or one of them alone: a run of bytes
    # that is not UTF-8 (ByteFallback reads it as one U+FFFD a byte, so a window that starts inside such a run
    # reads otherwise; a stream holds a trailing U+FFFD back until a later token settles it)
    units = [[t] for t in range(1, 10)] + [[10, 11, 12]] * 3 + [[10], [11], [12]]
    rng, rewrites = random.Random(0), 0
    for case in range(200):
        prompt = [rng.randrange(2, 10) for _ in range(rng.randrange(1, 8))]  # words and pieces: no cut character
        ids = [t for _ in range(rng.randrange(1, 20)) for t in rng.choice(units)]

        def text(out, prompt=prompt):
            return decode(prompt + list(out))[len(decode(prompt)) :]

        assert output_text(decode, prompt, ids, True) == text(ids), (case, prompt, ids)
        stop = [rng.choice([" Hello", " x", "o w", "!,", "\u20ac"]) for _ in range(rng.randrange(1, 3))]
        params = SamplingParams(max_tokens=64, stop=stop, min_tokens=rng.choice([0, 1, 3]))
        got = _found_in_calls(params, ids, decode, rng, prompt)
        # a run of bytes that is not UTF-8 reads as U+FFFD throughout, and once later bytes make it so, a "€" in it
        # that the text showed before reads so too: the output's text rewrites text a stream already sent; and a
        # stop string there is found as a tail of the output reads it (one that starts inside the run may read "€")
        rewritten = any(not text(ids).startswith(text(ids[:n]).rstrip("\ufffd")) for n in range(1, len(ids)))
        if "\ufffd" not in text(ids) or "\u20ac" not in stop:
            assert got == _by_hand(stop, params.min_tokens, ids, text), (case, prompt, ids, stop)
        sink, sent, n = _Sink(None, None, len(prompt), prompt=prompt), [], 0
        while n < len(ids):
            n = min(len(ids), n + rng.randrange(1, 6))
            sent.append(AsyncEngine._new_text(fake, sink, ids[:n], n == len(ids), params))
        start = len(text(ids[: params.min_tokens - 1])) if params.min_tokens > 1 else 0
        whole, joined = visible_text(text(ids), stop, True, start=start), "".join(sent)
        if not rewritten:
            assert joined == whole, (case, prompt, ids, stop)
        elif "\u20ac" not in stop:  # what was sent stays, and nothing is lost or doubled (the stream stalled at
            # the rewrite, and sent nothing more): the two read alike with each character a U+FFFD per UTF-8 byte
            def per_byte(t: str) -> str:
                return "".join(c if c.isascii() or c == "\ufffd" else "\ufffd" * len(c.encode()) for c in t)

            assert per_byte(joined) == per_byte(whole), (case, prompt, ids, stop)
            rewrites += 1
    assert decoder == "metaspace" or rewrites >= 10


def test_a_byte_level_output_reads_the_same_after_any_prompt(tmp_path):
    """A byte-level decoder keeps no space to drop: the output's text after its prompt is its text alone, whatever
    the prompt (one that ends in a cut character included), so its stop strings and deltas are as they were."""
    from tiny_models import make_tokenizer

    from spec_engine.sampling import output_text

    tok = make_tokenizer(tmp_path / "tok", corpus=["naïve café 日本語 déjà vu — ünïcödé ✓ 🙂 " * 4, "plain text"])

    def decode(ids, skip=True):
        return tok.decode(list(ids), skip_special_tokens=skip)

    rng = random.Random(0)
    for case in range(300):
        prompt = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 20))]
        assert output_text(decode, prompt, ids, True) == decode(ids), (case, prompt, ids)


def test_a_stop_string_at_the_start_of_a_sentencepiece_output_is_found(tmp_path):
    """A tiny model with a SentencePiece-style tokenizer, forced to emit "\u2581Hello": the output reads " Hello
    Hello Hello" after the prompt "Say" (decoded alone: "Hello Hello Hello"), a stop string " Hello" ends it at its
    first token (it was missed there, and the output ran a token past it), and the server's deltas join to the same
    text."""
    import asyncio

    from tiny_models import make_model

    from spec_engine.server.async_engine import AsyncEngine

    tok = _sentencepiece_tokenizer("metaspace")
    path = make_model(tmp_path / "spm", "llama_gqa", vocab_size=tok.get_vocab_size())
    tok.save(str(path / "tokenizer.json"))
    llm = LLM(str(path), max_model_len=64)
    hello = tok.token_to_id("\u2581Hello")
    forced = dict(max_tokens=3, allowed_token_ids=[hello])
    prompt = llm.encode("Say")
    out = llm.generate("Say", SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [hello] * 3
    assert out.text == llm.decode(prompt + out.token_ids)[len(llm.decode(prompt)) :] == " Hello Hello Hello"
    stopped = llm.generate("Say", SamplingParams(**forced, stop=[" Hello"]), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [hello] and stopped.text == "" and stopped.finish_reason == "stop"
    kept = SamplingParams(**forced, stop=[" Hello"], include_stop_str_in_output=True)
    assert llm.generate("Say", kept, use_tqdm=False)[0].outputs[0].text == " Hello"

    async def streamed(params: SamplingParams) -> list[str]:
        served = AsyncEngine(llm)
        try:
            return [d.text async for d in await served.add_request("Say", params)]
        finally:
            served.close()

    assert "".join(asyncio.run(streamed(SamplingParams(**forced)))) == " Hello Hello Hello"
    assert "".join(asyncio.run(streamed(kept))) == " Hello"


def test_a_stop_string_after_a_tail_that_starts_inside_a_bytefallback_character_is_found():
    """A ByteFallback decoder reads a run of "<0xNN>" byte tokens that is not UTF-8 as U+FFFD a byte, so a tail of the
    output that starts inside a character read all of its run as U+FFFD: "\u20ac" after "\u00e9\u00e9\u00e9\u00e9",
    or "\\n\\n" (Llama-2's "\\n" is "<0x0A>") after them, was never found (the request ran on to max_tokens). Random
    outputs of such runs and calls of 1-5 tokens: the token that completes a stop string is the by-hand reference's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "</s>", "\u2581Say", "\u2581Hello", "\u2581x"]
    words += ["<0xC3>", "<0xA9>", "<0xE2>", "<0x82>", "<0xAC>", "<0x0A>"]  # "\u00e9", "\u20ac", "\n"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )

    def decode(ids, skip=True):
        return tok.decode(list(ids), skip_special_tokens=skip)

    e, euro, nl = [5, 6], [7, 8, 9], [10]
    assert decode([3] + e * 4 + euro + nl) == "Hello\u00e9\u00e9\u00e9\u00e9\u20ac\n"
    assert stop_string_end(SamplingParams(stop=["\u20ac"]), e * 4 + euro[:2], euro[2:], decode, [2]) == 1
    assert stop_string_end(SamplingParams(stop=["\n\n"]), [3] + e * 4 + nl, nl, decode, [2]) == 1
    units = [[t] for t in range(1, 5)] + [e, euro, nl]
    rng = random.Random(0)
    for case in range(300):
        prompt = [rng.randrange(2, 5) for _ in range(rng.randrange(1, 4))]
        ids = [t for _ in range(rng.randrange(1, 24)) for t in rng.choice(units)]

        def text(out, prompt=prompt):
            return decode(prompt + list(out))[len(decode(prompt)) :]

        strings = ["\u20ac", "\n\n", "\u00e9\n", "\u00e9\u00e9\u00e9", " x"]
        stop = [rng.choice(strings) for _ in range(rng.randrange(1, 3))]
        params = SamplingParams(max_tokens=64, stop=stop, min_tokens=rng.choice([0, 1, 3]))
        got = _found_in_calls(params, ids, decode, rng, prompt)
        assert got == _by_hand(stop, params.min_tokens, ids, text), (case, prompt, ids, stop)
