"""The OpenAI-compatible server, end to end: real uvicorn servers on loopback, driven by the official ``openai``
client (and raw ``httpx`` for malformed requests).

Two servers share one tiny target checkpoint (byte-level BPE tokenizer, vocab 300, context 1024):
- ``plain``: no speculation, the default chat template, ``max_pending=16`` (for the 429 test);
- ``spec``: a draft model (a second checkpoint with the target's weights, so greedy acceptance is high and the
  figures are worth checking), a chat template from ``tokenizer_config.json``, ``max_pending=64``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import ClientDisconnect
from tiny_models import make_model, make_tokenizer, serve_in_thread

from spec_engine import LLM, SamplingParams
from spec_engine.server.app import create_app
from spec_engine.server.protocol import DEFAULT_CHAT_TEMPLATE

CONTEXT = 1024
LONG = CONTEXT - 64  # max_tokens of requests that must still be running when the test acts on them
CHAT_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
PROMPTS = ["hello world", "def fib(n):", "the quick brown fox", "naïve café 日本語", "speculative decoding", "x"]
BODY_LIMIT = 16384


@contextlib.contextmanager
def running_server(llm: LLM, name: str, max_pending: int, chat_template: str | None = None):
    """A real uvicorn server on a free loopback port, in a background thread; stopped and joined on exit."""
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)  # builds the C++ ext here, not mid-test
    app = create_app(llm, name, max_pending=max_pending, max_body_bytes=BODY_LIMIT, chat_template=chat_template)
    with serve_in_thread(app, log_level="warning") as port:
        yield f"http://127.0.0.1:{port}", app
    assert not app.state.engine.alive  # the lifespan shutdown stopped the engine loop


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_models")
    tok = make_tokenizer(root / "plain")
    vocab = tok.get_vocab_size()
    make_model(root / "plain", "llama_gqa", vocab_size=vocab, logit_scale=4.0, max_position_embeddings=CONTEXT)
    shutil.copytree(root / "plain", root / "templated")
    (root / "templated" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    make_tokenizer(root / "draft")
    make_model(root / "draft", "llama_gqa", vocab_size=vocab, logit_scale=4.0, max_position_embeddings=CONTEXT)
    return root, tok


@pytest.fixture(scope="module")
def plain(model_dirs):
    root, _ = model_dirs
    with running_server(LLM(root / "plain", max_num_seqs=16), "tiny-plain", max_pending=16) as s:
        yield s


@pytest.fixture(scope="module")
def spec(model_dirs):
    root, _ = model_dirs
    cfg = {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 3}
    with running_server(LLM(root / "templated", cfg, max_num_seqs=16), "tiny-spec", max_pending=64) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120)


def health(server) -> dict:
    r = httpx.get(server[0] + "/health")
    assert r.status_code == 200
    return r.json()


def wait_idle(server, timeout: float = 30) -> dict:
    """/health once nothing is in flight (aborts and finishes land at the next engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(server)
        if h["num_requests_in_flight"] == 0 and h["num_requests_running"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def complete(server, prompt: str, max_tokens: int = 12, **kw) -> str:
    out = client(server).completions.create(model=kw.pop("model", None) or name_of(server), prompt=prompt,
                                            max_tokens=max_tokens, temperature=0, **kw)  # fmt: skip
    return out.choices[0].text


def name_of(server) -> str:
    return httpx.get(server[0] + "/v1/models").json()["data"][0]["id"]


# --- the happy paths ---------------------------------------------------------------------------------------------


def test_models_and_health(plain, spec):
    for server, name in ((plain, "tiny-plain"), (spec, "tiny-spec")):
        models = client(server).models.list()
        assert [m.id for m in models.data] == [name]
        h = health(server)
        assert h["status"] == "ok" and h["kv_blocks_total"] > 0


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_completion(which, request):
    server = request.getfixturevalue(which)
    out = client(server).completions.create(model=name_of(server), prompt="hello world", max_tokens=10, temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"  # the tiny models have no EOS
    assert out.usage.completion_tokens == 10 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10
    assert isinstance(out.choices[0].text, str) and out.choices[0].text
    ids = [5, 17, 3, 60]  # token-id prompts work too
    out = client(server).completions.create(model=name_of(server), prompt=ids, max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 3
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    long = list(range(3, 75))  # 72 tokens: a second request takes the first 64's K/V from the prefix cache
    again = [client(server).completions.create(model=name_of(server), prompt=long, max_tokens=2, temperature=0)
             for _ in range(2)]  # fmt: skip
    assert [o.usage.prompt_tokens_details.cached_tokens for o in again] == [0, 64]
    assert again[1].choices[0].text == again[0].choices[0].text


@pytest.mark.parametrize("which,template", [("plain", DEFAULT_CHAT_TEMPLATE), ("spec", CHAT_TEMPLATE)])
def test_chat_uses_the_model_template_or_the_default(which, template, request, model_dirs):
    import jinja2

    server = request.getfixturevalue(which)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello server"}]
    out = client(server).chat.completions.create(model=name_of(server), messages=messages, max_tokens=6,
                                                 temperature=0)  # fmt: skip
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    rendered = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(model_dirs[1].encode(rendered).ids)
    assert out.usage.completion_tokens == 6


@pytest.mark.parametrize("which", ["plain", "spec"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_text_equals_non_streamed(which, endpoint, request):
    server = request.getfixturevalue(which)
    c, model = client(server), name_of(server)
    for prompt in PROMPTS[:3]:
        if endpoint == "completions":
            full = c.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
            chunks = list(c.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True))
            texts = [ch.choices[0].text for ch in chunks if ch.choices]
        else:
            msgs = [{"role": "user", "content": prompt}]
            kw = dict(model=model, messages=msgs, max_tokens=16, temperature=0)
            full = c.chat.completions.create(**kw).choices[0].message.content
            chunks = list(c.chat.completions.create(**kw, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            texts = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
        assert "".join(texts) == full
        finishing = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
        assert all(ch.choices and ch.usage is None for ch in chunks)  # no usage chunk unless include_usage asks


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_stop_strings_end_the_text_before_them_streamed_or_not(which, request):
    """The stop string (taken from the middle of the unstopped text) and everything after it are left out, streamed
    or not; a stream never sends the start of a stop string that a later token completes."""
    server = request.getfixturevalue(which)
    c, model = client(server), name_of(server)
    kw = dict(model=model, prompt="the quick brown fox", max_tokens=24, temperature=0)
    unstopped = c.completions.create(**kw).choices[0].text
    pieces = [ch.choices[0].text for ch in c.completions.create(**kw, stream=True) if ch.choices]
    ends = [len("".join(pieces[:k])) for k in range(1, len(pieces))]  # where one delta's text ends
    # where the text came in several deltas (the spec server's draft agrees with all of it: one delta), a stop
    # string that straddles two: its first half must be held back
    end = next((e for e in ends if 2 <= e <= len(unstopped) - 2), len(unstopped) // 2)
    stop = unstopped[end - 2 : end + 2]
    out = c.completions.create(**kw, stop=stop).choices[0]
    assert out.finish_reason == "stop" and out.text == unstopped[: unstopped.index(stop)]
    chunks = list(c.completions.create(**kw, stop=[stop, "never"], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == out.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    kept = dict(kw, stop=stop, extra_body={"include_stop_str_in_output": True})  # (vLLM's: the string kept)
    assert c.completions.create(**kept).choices[0].text == out.text + stop
    assert (
        "".join(ch.choices[0].text for ch in c.completions.create(**kept, stream=True) if ch.choices) == out.text + stop
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_choices_are_the_seeded_sequences_of_the_python_api_streamed_or_not(spec, model_dirs, endpoint):
    """n > 1: choice i is sequence i of ``LLM.generate`` with the same n and seed (choice 0: the request with n = 1),
    streamed or not; the usage counts the prompt once and every choice's tokens."""
    c, model = client(spec), name_of(spec)
    kw = dict(model=model, max_tokens=12, temperature=1.0, seed=11, n=3)
    if endpoint == "completions":
        kw["prompt"] = "the quick brown fox"
        create, text = c.completions.create, lambda ch: ch.text
        delta = lambda ch: ch.text  # noqa: E731
    else:
        kw["messages"] = [{"role": "user", "content": "the quick brown fox"}]
        create, text = c.chat.completions.create, lambda ch: ch.message.content
        delta = lambda ch: ch.delta.content or ""  # noqa: E731
    out = create(**kw)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    texts = [text(ch) for ch in out.choices]
    assert len(set(texts)) > 1  # distinct sequences
    assert text(create(**{**kw, "n": 1}).choices[0]) == texts[0]
    assert out.usage.completion_tokens == 3 * 12 and out.usage.total_tokens == out.usage.prompt_tokens + 36
    streamed, finishes = ["", "", ""], []
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for ch in chunk.choices:
            streamed[ch.index] += delta(ch)
            if ch.finish_reason:
                finishes.append(ch.index)
    assert streamed == texts and sorted(finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 36
    if endpoint == "completions":  # the Python API's sequences (seeded sampling is the same with or without a draft)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, n=3)
        ref = LLM(model_dirs[0] / "plain").generate(kw["prompt"], params, use_tqdm=False)[0]
        assert [o.text for o in ref.outputs] == texts
    assert wait_idle(spec)["kv_blocks_used"] == 0


def test_logprobs_are_the_python_apis_streamed_or_not(plain, spec, model_dirs):
    """Completions' logprobs (tokens, their logprobs, the alternatives, text offsets) and chat's (token, logprob,
    bytes, top_logprobs): the Python API's values, the same on the speculative server, streamed or not."""
    prompt = "naïve café 日本語"
    params = SamplingParams(max_tokens=16, logprobs=2)
    ref = LLM(model_dirs[0] / "plain").generate(prompt, params, use_tqdm=False)[0].outputs[0]
    tok = model_dirs[1]
    for server in (plain, spec):
        c, model = client(server), name_of(server)
        kw = dict(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
        out = c.completions.create(**kw).choices[0]
        lp = out.logprobs
        texts = [tok.decode([t]) for t in ref.token_ids]
        assert "\ufffd" in "".join(texts)  # (some tokens hold part of a character: named by their bytes)
        assert [t if "\ufffd" not in t else "bytes" for t in texts] == [t.split(":")[0] for t in lp.tokens]
        assert all(abs(a - b[t]) < 1e-4 for a, b, t in zip(lp.token_logprobs, ref.logprobs, ref.token_ids))
        assert [len(d) for d in lp.top_logprobs] == [len(e) for e in ref.logprobs]  # (distinct keys)
        assert all(d[t] == v for d, t, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
        assert lp.text_offset == [sum(map(len, texts[:j])) for j in range(len(texts))]
        chunks = [ch.choices[0].logprobs for ch in c.completions.create(**kw, stream=True) if ch.choices]
        assert [t for ch in chunks if ch for t in ch.tokens] == lp.tokens
        assert [o for ch in chunks if ch for o in ch.text_offset] == lp.text_offset
        msgs = [{"role": "user", "content": prompt}]
        chat = c.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0, logprobs=True,
                                         top_logprobs=2).choices[0]  # fmt: skip
        content = chat.logprobs.content
        assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == chat.message.content
        for e in content:  # greedy: each token is its position's most likely
            assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
            assert e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob
        streamed = c.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0, logprobs=True,
                                             top_logprobs=2, stream=True)  # fmt: skip
        entries = [
            e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content
        ]
        assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]


def test_prompt_logprobs_are_the_python_apis(plain, spec, model_dirs):
    """vLLM's prompt_logprobs: per prompt token after the first, {id: logprob, rank, decoded_token} for it and its
    alternatives, the Python API's values; in completions' first chunk when streamed; in chat, the response's
    (not with stream: 400); with echo, logprobs must ask for as many."""
    prompt = "the quick brown fox"
    ref = LLM(model_dirs[0] / "plain").generate(prompt, SamplingParams(max_tokens=4, prompt_logprobs=2),
                                                use_tqdm=False)[0]  # fmt: skip
    tok = model_dirs[1]

    def check(got: list) -> None:
        assert got[0] is None and len(got) == len(ref.prompt_token_ids)
        for entry, want, token in zip(got[1:], ref.prompt_logprobs[1:], ref.prompt_token_ids[1:]):
            assert {int(t) for t in entry} == set(want) and str(token) in entry
            assert all(abs(entry[str(t)]["logprob"] - v) < 1e-4 for t, v in want.items())
            ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
            assert ranks == [1, 2] and entry[str(token)]["decoded_token"] == tok.decode([token])

    for server in (plain, spec):
        body = {"model": name_of(server), "prompt": prompt, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2}
        check(httpx.post(server[0] + "/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"])
        with httpx.stream("POST", server[0] + "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        firsts = [ch["choices"][0]["prompt_logprobs"] for ch in chunks if ch["choices"] and "prompt_logprobs" in
                  ch["choices"][0]]  # fmt: skip
        assert len(firsts) == 1
        check(firsts[0])
        bad = httpx.post(server[0] + "/v1/completions", json={**body, "echo": True, "logprobs": 1})
        assert bad.status_code == 400 and "prompt_logprobs" in bad.text
        # a stop string the whole output may still begin holds every token's text back: the first chunk goes anyway
        text = httpx.post(server[0] + "/v1/completions", json=body).json()["choices"][0]["text"]
        with httpx.stream("POST", server[0] + "/v1/completions",
                          json={**body, "stream": True, "stop": [text + "never"]}) as r:  # fmt: skip
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        check(next(ch["choices"][0]["prompt_logprobs"] for ch in chunks if ch["choices"]))
    chat = {"model": name_of(plain), "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
            "prompt_logprobs": 1}  # fmt: skip
    got = httpx.post(plain[0] + "/v1/chat/completions", json=chat).json()
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == got["usage"]["prompt_tokens"]
    bad = httpx.post(plain[0] + "/v1/chat/completions", json={**chat, "stream": True})
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_echo_with_logprobs_scores_the_prompt_streamed_or_not(which, request, model_dirs):
    """``echo`` puts the prompt before the completion; with ``logprobs`` the prompt tokens' come first (the first
    token's null), the Python API's ``prompt_logprobs``: what an evaluation harness reads a loglikelihood from."""
    server = request.getfixturevalue(which)
    c, model = client(server), name_of(server)
    prompt = "the quick brown fox jumps"
    plain_text = c.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0).choices[0].text
    assert c.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                echo=True).choices[0].text == prompt + plain_text  # fmt: skip
    ids = model_dirs[1].encode(prompt).ids
    ref = LLM(model_dirs[0] / "plain").generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1),
                                                use_tqdm=False)[0]  # fmt: skip
    kw = dict(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = c.completions.create(**kw).choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for got, entry, token in zip(lp.token_logprobs[1 : len(ids)], ref.prompt_logprobs[1:], ids[1:]):
        assert abs(got - entry[token]) < 1e-4
    streamed = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(ch.text for ch in streamed).startswith(prompt)
    assert [x for ch in streamed if ch.logprobs for x in ch.logprobs.token_logprobs] == lp.token_logprobs


def test_echo_with_prompt_logprobs_alone_leaves_logprobs_null(plain):
    """``echo`` with vLLM's ``prompt_logprobs`` but no ``logprobs``: the choice's ``logprobs`` stays null, streamed
    or not (it held the prompt's tokens alone, not covering the text), and ``prompt_logprobs`` carries them."""
    body = {"prompt": "the quick brown fox", "max_tokens": 3, "temperature": 0, "echo": True, "prompt_logprobs": 1}
    choice = httpx.post(plain[0] + "/v1/completions", json=body).json()["choices"][0]
    assert choice["logprobs"] is None and choice["prompt_logprobs"][0] is None
    with httpx.stream("POST", plain[0] + "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert all(ch["logprobs"] is None for ch in choices) and "prompt_logprobs" in choices[0]
    assert "".join(ch["text"] for ch in choices) == choice["text"]


def test_penalties_over_http_are_the_python_apis(plain, spec, model_dirs):
    """presence / frequency / repetition penalties: the Python API's tokens, with and without speculation."""
    pens = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3)
    prompt = "the quick brown fox"
    ref = LLM(model_dirs[0] / "plain").generate(prompt, SamplingParams(max_tokens=16, **pens), use_tqdm=False)[0]
    unpenalised = complete(plain, prompt, 16)
    assert ref.outputs[0].text != unpenalised
    for server in (plain, spec):
        assert complete(server, prompt, 16, extra_body={"repetition_penalty": 1.3}, presence_penalty=0.5,
                        frequency_penalty=1.0) == ref.outputs[0].text  # fmt: skip
    free = LLM(model_dirs[0] / "plain").generate(prompt, SamplingParams(max_tokens=16), use_tqdm=False)[0]
    first = free.outputs[0].token_ids[0]
    bias = {first: -100.0}
    ref = LLM(model_dirs[0] / "plain").generate(prompt, SamplingParams(max_tokens=16, logit_bias=bias, min_tokens=6,
                                                stop_token_ids=[5]), use_tqdm=False)[0]  # fmt: skip
    assert first not in ref.outputs[0].token_ids
    for server in (plain, spec):
        got = complete(server, prompt, 16, logit_bias={str(first): -100}, extra_body={"min_tokens": 6,
                       "stop_token_ids": [5]})  # fmt: skip
        assert got == ref.outputs[0].text


def test_special_tokens_truncated_prompts_bad_words_and_choices_over_http():
    """vLLM's skip_special_tokens (the embedded target's "<|endoftext|>" forced by allowed_token_ids),
    truncate_prompt_tokens (the prompt's last k tokens: usage counts them, echo shows them), bad_words and
    guided_choice, streamed or not: the Python API's text."""
    from spec_engine import default_model_paths

    llm = LLM(default_model_paths()[0], max_model_len=512)
    forced = {"allowed_token_ids": [0], "ignore_eos": True}
    prompt = "def fibonacci(n):\n    # the n-th Fibonacci number\n"
    ids = llm.encode(prompt)
    ref = llm.generate({"prompt_token_ids": ids[-4:]}, SamplingParams(max_tokens=8), use_tqdm=False)[0].outputs[0]
    apart = LLM(default_model_paths()[0], max_model_len=512)  # the Python API's answers: not the served engine
    with running_server(llm, "embedded", max_pending=4) as server:
        c, model = client(server), name_of(server)
        for stream in (False, True):
            texts = []
            for skip in (True, False):
                kw = dict(model=model, prompt="x", max_tokens=3, temperature=0, stream=stream,
                          extra_body={**forced, "skip_special_tokens": skip})  # fmt: skip
                out = c.completions.create(**kw)
                texts.append("".join(ch.choices[0].text for ch in out if ch.choices) if stream else out.choices[0].text)
            assert texts == ["", "<|endoftext|>" * 3], stream
        out = c.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, echo=True,
                                   extra_body={"truncate_prompt_tokens": 4})  # fmt: skip
        assert out.usage.prompt_tokens == 4 and out.choices[0].text == llm.decode(ids[-4:]) + ref.text
        msgs = [{"role": "user", "content": prompt}]
        chat = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 3})  # fmt: skip
        assert chat.usage.prompt_tokens == 3
        bad = httpx.post(server[0] + "/v1/completions", json={"model": model, "prompt": "x",
                                                              "truncate_prompt_tokens": 0})  # fmt: skip
        assert bad.status_code == 400 and "truncate_prompt_tokens" in bad.text
        prose = "import os\n\n"
        free = apart.generate(prose, SamplingParams(max_tokens=24), use_tqdm=False)[0].outputs[0].text
        words = [w for w in free.split() if w.isalpha() and len(w) > 2][:2]
        want = apart.generate(prose, SamplingParams(max_tokens=24, bad_words=words), use_tqdm=False)[0].outputs[0]
        assert len(words) == 2 and want.text != free
        for stream in (False, True):
            out = c.completions.create(model=model, prompt=prose, max_tokens=24, temperature=0, stream=stream,
                                       extra_body={"bad_words": words})  # fmt: skip
            assert (
                "".join(ch.choices[0].text for ch in out if ch.choices) if stream else out.choices[0].text
            ) == want.text
        bad = httpx.post(server[0] + "/v1/completions", json={"model": model, "prompt": "x", "bad_words": [" "]})
        assert bad.status_code == 400 and "bad_words" in bad.text
        choices = ["positive", "negative", "(none)"]
        want = apart.generate(prose, SamplingParams(max_tokens=8, guided_choice=choices), use_tqdm=False)[0].outputs[0]
        msgs = [{"role": "user", "content": "Sentiment of 'I loved it'?"}]
        for stream in (False, True):
            out = c.completions.create(model=model, prompt=prose, max_tokens=8, temperature=0, stream=stream,
                                       extra_body={"guided_choice": choices})  # fmt: skip
            text = "".join(ch.choices[0].text for ch in out if ch.choices) if stream else out.choices[0].text
            assert text == want.text and text in choices
            chat = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=stream,
                                             extra_body={"guided_choice": choices})  # fmt: skip
            text = "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices) if stream else (
                chat.choices[0].message.content)  # fmt: skip
            assert text in choices
        bad = httpx.post(server[0] + "/v1/completions", json={"model": model, "prompt": "x", "guided_choice": [],
                                                              "max_tokens": 4})  # fmt: skip
        assert bad.status_code == 400 and "guided_choice" in bad.text
        body = {"model": model, "prompt": prose, "max_tokens": 8, "temperature": 0}
        same = httpx.post(server[0] + "/v1/completions", json={**body, "structured_outputs": {"choice": choices}})
        assert same.json()["choices"][0]["text"] == want.text  # (vLLM's newer form of guided_choice)
        for so in ({"json": 5}, {"choice": "yes"}, {"regex": "a", "choice": ["a"]}, {"xml": "<a/>"},
                   {"disable_any_whitespace": "yes"}):  # fmt: skip
            bad = httpx.post(server[0] + "/v1/completions", json={**body, "structured_outputs": so})
            assert bad.status_code == 400 and "structured_outputs" in bad.text, bad.text
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}  # fmt: skip
        for name, guide, extra in (
            ("json_schema", dict(guided_json=schema), {"response_format": {"type": "json_schema", "json_schema": {
                "name": "verdict", "schema": schema}}}),
            ("json_object", dict(guided_json={"type": "object"}), {"response_format": {"type": "json_object"}}),
            ("regex", dict(guided_regex="(yes|no)[.!]"), {"structured_outputs": {"regex": "(yes|no)[.!]"}}),
            ("json_compact", dict(guided_json=schema, disable_any_whitespace=True),
             {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}),
            ("json_schema_compact", dict(guided_json=schema, disable_any_whitespace=True), {"response_format": {
                "type": "json_schema", "json_schema": {"schema": schema}}, "structured_outputs": {
                "disable_any_whitespace": True}}),
            ("named_twice", dict(guided_json=schema), {"guided_json": json.dumps(schema), "response_format": {
                "type": "json_schema", "json_schema": {"schema": dict(reversed(schema.items()))}}}),
            ("gbnf", dict(guided_grammar='root ::= "yes" | "no"'), {"guided_grammar": 'root ::= "yes" | "no"'}),
        ):  # fmt: skip
            want = apart.chat(msgs, SamplingParams(max_tokens=24, **guide), use_tqdm=False)[0].outputs[0]
            for stream in (False, True):
                chat = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0,
                                                 stream=stream, extra_body=extra)  # fmt: skip
                text = "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices) if stream else (
                    chat.choices[0].message.content)  # fmt: skip
                assert text == want.text, (name, stream)
            if want.finish_reason == "stop" and "guided_json" in guide:
                assert isinstance(json.loads(want.text), dict), name


TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}},
]  # fmt: skip


def test_tool_calls_over_http():
    """tool_choice naming a function: its arguments are JSON following its parameters (the Python API's guided_json
    answer), as one tool call, streamed piece by piece; "required": calls of the tools, as an array, one without
    parallel_tool_calls; "auto", unknown names and choices without tools get 400; an earlier call and its tool
    message in the history render."""
    from spec_engine import default_model_paths
    from spec_engine.server.tools import tool_schema

    llm = LLM(default_model_paths()[0], max_model_len=512)
    apart = LLM(default_model_paths()[0], max_model_len=512)  # the Python API's answers: not the served engine
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    add = {"type": "function", "function": {"name": "add"}}
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    with running_server(llm, "embedded", max_pending=4) as server:
        c, model = client(server), name_of(server)
        kw = dict(model=model, messages=msgs, max_tokens=48, temperature=0, tools=TOOLS, extra_body=compact)
        want = apart.chat(msgs, SamplingParams(max_tokens=48, guided_json=TOOLS[0]["function"]["parameters"],
                                             disable_any_whitespace=True), use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert want.finish_reason == "stop"
        out = c.chat.completions.create(tool_choice=add, **kw).choices[0]
        assert out.finish_reason == "stop" and out.message.content is None
        (call,) = out.message.tool_calls
        assert call.function.name == "add" and call.function.arguments == want.text and call.id
        assert set(json.loads(call.function.arguments)) == {"a", "b"}
        chunks = list(c.chat.completions.create(tool_choice=add, stream=True, **kw))
        heads = [ch.choices[0].delta.tool_calls[0] for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
        assert heads[0].function.name == "add" and heads[0].id and all(h.index == 0 for h in heads)
        assert "".join(h.function.arguments or "" for h in heads) == want.text
        for parallel in (True, False):
            schema = tool_schema(TOOLS, "required", parallel)
            ref = apart.chat(msgs, SamplingParams(max_tokens=96, guided_json=schema, disable_any_whitespace=True),
                           use_tqdm=False)[0].outputs[0]  # fmt: skip
            assert ref.finish_reason == "stop"
            calls = [(x["name"], x["parameters"]) for x in json.loads(ref.text)]
            got = c.chat.completions.create(tool_choice="required", parallel_tool_calls=parallel,
                                            **{**kw, "max_tokens": 96}).choices[0]  # fmt: skip
            assert got.finish_reason == "tool_calls" and got.message.content is None
            assert [(t.function.name, json.loads(t.function.arguments)) for t in got.message.tool_calls] == calls
            assert parallel or len(calls) == 1
            streamed = [ch for ch in c.chat.completions.create(tool_choice="required", parallel_tool_calls=parallel,
                        stream=True, **{**kw, "max_tokens": 96}) if ch.choices]  # fmt: skip
            last = [ch.choices[0] for ch in streamed if ch.choices[0].delta.tool_calls]
            assert len(last) == 1 and last[0].finish_reason == "tool_calls"
            assert [(t.function.name, json.loads(t.function.arguments)) for t in last[0].delta.tool_calls] == calls
        history = msgs + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ]  # fmt: skip
        text = c.chat.completions.create(model=model, messages=history, max_tokens=4, temperature=0, tools=TOOLS,
                                         tool_choice="none").choices[0].message.content  # fmt: skip
        assert isinstance(text, str)
        deep = [*msgs, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "add", "arguments": "[" * 5000}}]}]  # fmt: skip
        assert c.chat.completions.create(model=model, messages=deep, max_tokens=2).choices[0].message.content
        # cut short: a named call keeps its partial arguments (vLLM's), "required" answers the text, streamed or not
        cut = {**kw, "max_tokens": 3}
        got = c.chat.completions.create(tool_choice=add, **cut).choices[0]
        assert got.finish_reason == "length" and got.message.tool_calls[0].function.arguments == want.text[: len(
            got.message.tool_calls[0].function.arguments)]  # fmt: skip
        pieces = [ch.choices[0] for ch in c.chat.completions.create(tool_choice=add, stream=True, **cut) if ch.choices]
        assert "".join(p.delta.tool_calls[0].function.arguments or "" for p in pieces if p.delta.tool_calls) == (
            got.message.tool_calls[0].function.arguments) and pieces[-1].finish_reason == "length"  # fmt: skip
        held = dict(tool_choice="required", stop=['"name"'], logprobs=True, **{**kw, "max_tokens": 96})
        whole = c.chat.completions.create(**held).choices[0]
        assert whole.finish_reason == "stop" and whole.message.content == "[{" and not whole.message.tool_calls
        last = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **held) if ch.choices][-1]
        assert last.finish_reason == "stop" and last.delta.content == "[{" and not last.delta.tool_calls
        assert len(last.logprobs.content) == len(whole.logprobs.content)
        entries = c.chat.completions.create(tool_choice="required", logprobs=True, **{**kw, "max_tokens": 96})
        streamed = [ch.choices[0] for ch in c.chat.completions.create(tool_choice="required", logprobs=True,
                    stream=True, **{**kw, "max_tokens": 96}) if ch.choices]  # fmt: skip
        assert [e.token for e in streamed[-1].logprobs.content] == [
            e.token for e in entries.choices[0].logprobs.content
        ]
        body = {"model": model, "messages": msgs, "max_tokens": 4}
        for bad, param in (
            ({"tools": TOOLS}, "tool_choice"),  # (OpenAI's default with tools is "auto")
            ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
            ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
             "tools[0].function.name"),
            ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
            ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
              "tool_choice": "required"}, "tools[0].function.parameters"),
            ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "tool_choice"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/missing"}}}],
              "tool_choice": "required"}, "tools"),
        ):  # fmt: skip
            r = httpx.post(server[0] + "/v1/chat/completions", json={**body, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_tool_calls_and_tools_reach_the_template():
    """An assistant's earlier calls (arguments parsed; a message with no content still has one), a tool message's
    id and name, and the tools, as a template reads them."""
    from spec_engine.chat_template import ChatTemplate
    from spec_engine.server.protocol import ChatCompletionRequest

    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}<{{ m.role }}>"
                "{{ m.content }}{% for c in m.tool_calls or [] %}({{ c.function.name }} a={{ c.function.arguments.a }})"
                "{% endfor %}{% if m.tool_call_id is defined %}#{{ m.tool_call_id }}/{{ m.name }}{% endif %}"
                "{% endfor %}")  # fmt: skip
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"}], "tools": TOOLS})  # fmt: skip
    messages, tools = req.template_inputs()
    text = ChatTemplate(None, source=template).render(messages, add_generation_prompt=False, tools=tools)
    assert text == "[tool add][tool weather]<user>2 + 3?<assistant>(add a=2)<tool>5#c1/add", text


def test_tokenize_and_detokenize_are_the_apis_own(plain, spec, model_dirs):
    """/tokenize gives the token ids the completions API makes of a prompt and the chat API of a conversation (the
    usage's prompt_tokens), /detokenize their text back; bad input gets 400 naming the field."""
    url, (root, tok) = spec[0], model_dirs
    llm = LLM(root / "templated")  # (not the served one: LLM.generate on a served LLM raises)
    r = httpx.post(url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == llm.encode("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == llm.max_model_len
    assert body["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]]
    assert httpx.post(url + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()[
        "tokens"] == llm.encode("hello world", add_special_tokens=False)  # fmt: skip
    messages = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert chat["token_strs"] is None
    used = client(spec).chat.completions.create(model=name_of(spec), messages=messages, max_tokens=2, temperature=0)
    assert chat["count"] == used.usage.prompt_tokens
    assert chat["tokens"] == llm.render_chat(messages)[1]
    bare = httpx.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == llm.render_chat(messages, add_generation_prompt=False)[1]
    asked = {"messages": messages, "add_generation_prompt": False}  # (the default template reads it)
    plain_llm, plain_url = LLM(root / "plain"), plain[0]
    bare = httpx.post(plain_url + "/tokenize", json=asked).json()["tokens"]
    assert bare == plain_llm.render_chat(messages, add_generation_prompt=False)[1] != plain_llm.render_chat(messages)[1]
    r = httpx.post(url + "/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == llm.decode(body["tokens"], skip_special_tokens=False)
    assert httpx.get(url + "/version").json()["version"]
    for path, bad, param in (("/tokenize", {}, None), ("/tokenize", {"prompt": "a", "messages": messages}, None),
                             ("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {"messages": []}, "messages"),
                             ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
                             ("/detokenize", {"tokens": [-1]}, "tokens"),
                             ("/detokenize", {"tokens": [10**9]}, "tokens"),
                             ("/detokenize", {"tokens": "12"}, "tokens")):  # fmt: skip
        r = httpx.post(url + path, json=bad)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, bad, r.text)


def test_concurrent_choices_never_pass_max_pending(plain):
    """Three requests of n = 10 at once on a server that runs 16: one is admitted, two get 429, however their
    choices' additions interleave (the engine is held while they arrive)."""
    body = {"prompt": "hold", "max_tokens": 4, "temperature": 0, "n": 10}
    with ThreadPoolExecutor(3) as pool:
        with gated_steps(plain):
            jobs = [pool.submit(httpx.post, plain[0] + "/v1/completions", json=body, timeout=60) for _ in range(3)]
            deadline = time.monotonic() + 30
            while sum(j.done() for j in jobs) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            # the refused ones come back while the admitted one waits for the engine
            assert [j.result().status_code for j in jobs if j.done()] == [429, 429]
    statuses = sorted(j.result().status_code for j in jobs)
    assert statuses == [200, 429, 429]
    assert len(next(j.result() for j in jobs if j.result().status_code == 200).json()["choices"]) == 10
    assert wait_idle(plain)["kv_blocks_used"] == 0


def test_null_means_absent_for_the_new_fields(plain):
    for path, body in (("/v1/completions", {"prompt": "x", "echo": None, "logprobs": None, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": None,
                                                 "top_logprobs": None, "max_tokens": 2})):  # fmt: skip
        r = httpx.post(plain[0] + path, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] is None


def test_token_texts_follow_the_tokenizers_convention(model_dirs):
    """A logprob's token text and bytes: a byte-level piece's own bytes (part of a character: ``bytes:\\xNN``),
    SentencePiece's word-boundary space and byte-fallback pieces (decoding such a token alone drops the space and
    shows U+FFFD), a special token's name."""
    from spec_engine.server.logprobs import logprob_token_text

    class SentencePieceLike:  # (a Metaspace decoder: id_to_token and a decode that strips a leading space)
        decoder = None
        pieces = ["\u2581the", "ing", "<0xE6>", "</s>"]

        def id_to_token(self, i):
            return self.pieces[i]

        def decode(self, ids):
            piece = self.pieces[ids[0]]
            return (
                "" if piece == "</s>" else "\ufffd" if piece.startswith("<0x") else piece.replace("\u2581", " ").strip()
            )

    sp = SentencePieceLike()
    expected = [(" the", b" the"), ("ing", b"ing"), ("bytes:\\xe6", b"\xe6"), ("</s>", b"</s>")]
    assert [logprob_token_text(sp, i) for i in range(4)] == expected
    tok = model_dirs[1]  # byte-level: "é" is one token here or two; each token's bytes join into it
    ids = tok.encode("café 日本").ids
    parts = [logprob_token_text(tok, i) for i in ids]
    assert b"".join(raw for _, raw in parts).decode() == tok.decode(ids)
    assert all(not text.startswith("bytes:") or "\ufffd" in tok.decode([i]) for (text, _), i in zip(parts, ids))
    assert logprob_token_text(None, 7) == ("token_id:7", b"token_id:7")


def test_logprobs_json_has_no_infinity():
    """A token with no probability (a -inf log-probability; NaN too) is OpenAI's -9999, never JSON's invalid
    -Infinity."""
    from spec_engine.server.logprobs import LOGPROB_FLOOR, chat_content_logprobs, completion_logprobs

    entries = [{3: float("-inf"), 4: -0.1, 5: float("nan")}]
    text = lambda t: (f"t{t}", b"t")  # noqa: E731
    out, _ = completion_logprobs([3], entries, text, 0)
    assert out["token_logprobs"] == [LOGPROB_FLOOR] and out["top_logprobs"][0] == {"t3": LOGPROB_FLOOR, "t4": -0.1,
                                                                                    "t5": LOGPROB_FLOOR}  # fmt: skip
    content = chat_content_logprobs([3], entries, text, 2)
    assert json.loads(json.dumps(content, allow_nan=False))[0]["logprob"] == LOGPROB_FLOOR


def test_the_usage_chunk_only_when_asked(plain):
    """OpenAI's and vLLM's rule: a stream ends with a usage chunk (no choices) only where include_usage asks."""
    c = client(plain)
    kw = dict(model=name_of(plain), prompt="hi", max_tokens=4, temperature=0, stream=True)
    chunks = list(c.completions.create(**kw, stream_options={"include_usage": False}))
    assert all(ch.choices for ch in chunks) and all(ch.usage is None for ch in chunks)
    chunks = list(c.completions.create(**kw, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(ch.choices and ch.usage is None for ch in chunks[:-1])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(plain, endpoint):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries its choice's usage so far (the chat's
    opening chunk none of the completion yet), beside the final usage chunk; not without ``include_usage``."""
    c, model = client(plain), name_of(plain)
    kw = dict(model=model, max_tokens=6, temperature=1.0, seed=5, n=2, stream=True)
    if endpoint == "completions":
        create, kw["prompt"] = c.completions.create, "the quick brown fox"
    else:
        create, kw["messages"] = c.chat.completions.create, [{"role": "user", "content": "the quick brown fox"}]
    chunks = list(create(**kw, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    final, chunks = chunks[-1], chunks[:-1]
    assert final.choices == [] and final.usage.completion_tokens == 12
    prompt, seen = final.usage.prompt_tokens, {0: 0, 1: 0}
    for ch in chunks:
        assert ch.usage is not None and ch.usage.prompt_tokens == prompt
        assert ch.usage.total_tokens == prompt + ch.usage.completion_tokens
        if endpoint == "chat" and ch.choices[0].delta.role:  # (the opening chunk, every choice's role)
            assert ch.usage.completion_tokens == 0
            continue
        (choice,) = ch.choices
        assert ch.usage.completion_tokens >= seen[choice.index]
        seen[choice.index] = ch.usage.completion_tokens
    assert seen == {0: 6, 1: 6}
    quiet = list(create(**kw, stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(ch.usage is None for ch in quiet)


def test_speculation_is_lossless_over_http(plain, spec):
    for prompt in PROMPTS:
        assert complete(spec, prompt, 16) == complete(plain, prompt, 16)


def test_seeded_samples_are_drafter_invariant_over_http(plain, spec):
    """A seeded request's text is the same on the plain server, on the speculative one alone, and among concurrent
    requests there, streamed or not (the position-keyed coupling of spec_engine/coupling.py)."""
    kw = dict(temperature=0.8, seed=7, max_tokens=24, top_p=0.95)

    def sample(server, prompt: str, stream: bool = False) -> str:
        out = client(server).completions.create(model=name_of(server), prompt=prompt, stream=stream, **kw)
        return "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text

    prompts = PROMPTS[:3]
    reference = [sample(plain, p) for p in prompts]
    assert [sample(spec, p) for p in prompts] == reference
    with ThreadPoolExecutor(12) as pool:
        jobs = [pool.submit(sample, spec, prompts[i % 3], i % 2 == 1) for i in range(8)]
        neighbours = [pool.submit(complete, spec, "x" * (i + 1), 20) for i in range(4)]  # greedy rows beside them
        assert [j.result() for j in jobs] == [reference[i % 3] for i in range(8)]
        assert all(isinstance(n.result(), str) for n in neighbours)


def test_16_concurrent_greedy_requests_match_sequential(spec):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    sequential = [complete(spec, p, 12) for p in prompts]
    before = health(spec)["num_steps"]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda p: complete(spec, p, 12), prompts))
    assert concurrent == sequential
    assert health(spec)["num_steps"] > before


def test_chat_requests_without_max_tokens_share_a_small_cache(model_dirs, monkeypatch):
    """Chat requests that set no max_tokens may run to the end of the context (1,024 tokens here), but hold only the
    KV blocks they have written: on a cache of 48 blocks of 32, where each could take 33, six run side by side, the
    newest preempted and resumed as the others grow, and each answers as it does alone."""
    import spec_engine.llm as llm_mod

    root, _ = model_dirs
    monkeypatch.setattr(llm_mod, "plan_num_blocks", lambda *args: 48)
    cfg = {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 3}
    with running_server(LLM(root / "templated", cfg, max_num_seqs=8), "tiny-tight", max_pending=16) as server:

        def chat(text: str) -> str:
            out = client(server).chat.completions.create(model="tiny-tight", temperature=0,
                                                         messages=[{"role": "user", "content": text}])  # fmt: skip
            return out.choices[0].message.content

        prompts = PROMPTS
        alone = [chat(p) for p in prompts]
        assert health(server)["num_preemptions"] == 0
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(chat, prompts)) == alone
        h = wait_idle(server)
        assert h["num_preemptions"] > 0 and h["kv_blocks_used"] == 0


# --- limits and errors -------------------------------------------------------------------------------------------


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


BAD_REQUESTS = {  # name: (path, raw body, status, param)
    "bad_json": ("/v1/completions", b'{"prompt": "x", ', 400, None),
    "not_an_object": ("/v1/completions", b"[1, 2]", 400, None),
    "missing_prompt": ("/v1/completions", _json({"max_tokens": 4}), 400, "prompt"),
    "empty_prompt": ("/v1/completions", _json({"prompt": []}), 400, "prompt"),
    "batched_prompts": ("/v1/completions", _json({"prompt": ["a", "b"]}), 400, "prompt"),
    "missing_messages": ("/v1/chat/completions", _json({"max_tokens": 4}), 400, "messages"),
    "bad_role": (
        "/v1/chat/completions",
        _json({"messages": [{"role": "robot", "content": "x"}]}),
        400,
        "messages[0].role",
    ),
    "max_tokens_0": ("/v1/completions", _json({"prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
    "max_tokens_past_context": ("/v1/completions", _json({"prompt": "x", "max_tokens": CONTEXT}), 400, "max_tokens"),
    "prompt_past_context": (
        "/v1/completions",
        _json({"prompt": [7] * (CONTEXT + 5), "max_tokens": 1}),
        400,
        "prompt",
    ),
    "chat_past_context": (
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "fox " * (2 * CONTEXT)}]}),
        400,
        "prompt",
    ),
    "temperature_negative": ("/v1/completions", _json({"prompt": "x", "temperature": -0.5}), 400, "temperature"),
    "temperature_string": ("/v1/completions", _json({"prompt": "x", "temperature": "0.5"}), 400, "temperature"),
    "top_p_zero": ("/v1/completions", _json({"prompt": "x", "top_p": 0}), 400, "top_p"),
    "top_p_above_one": ("/v1/completions", _json({"prompt": "x", "top_p": 1.5}), 400, "top_p"),
    "n_0": ("/v1/completions", _json({"prompt": "x", "n": 0}), 400, "n"),
    "n_past_max_pending": ("/v1/completions", _json({"prompt": "x", "n": 17}), 400, "n"),  # (plain: max_pending 16)
    "token_out_of_vocab": ("/v1/completions", _json({"prompt": [1, 2, 10**6]}), 400, "prompt"),
    "stop_empty_string": ("/v1/completions", _json({"prompt": "x", "stop": [""]}), 400, "stop"),
    "stop_not_strings": ("/v1/completions", _json({"prompt": "x", "stop": [3]}), 400, "stop"),
    "logprobs_past_20": ("/v1/completions", _json({"prompt": "x", "logprobs": 21}), 400, "logprobs"),
    "logprobs_true": ("/v1/completions", _json({"prompt": "x", "logprobs": True}), 400, "logprobs"),
    "top_logprobs_without_logprobs": (
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        400,
        "top_logprobs",
    ),
    "chat_echo": (
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "x"}], "echo": True}),
        400,
        "echo",
    ),  # fmt: skip
    "top_logprobs_on_completions": ("/v1/completions", _json({"prompt": "x", "top_logprobs": 2}), 400, "top_logprobs"),
    "repetition_penalty_zero": (
        "/v1/completions",
        _json({"prompt": "x", "repetition_penalty": 0}),
        400,
        "repetition_penalty",
    ),  # fmt: skip
    "presence_penalty_past_2": (
        "/v1/completions",
        _json({"prompt": "x", "presence_penalty": 2.5}),
        400,
        "presence_penalty",
    ),  # fmt: skip
    "allowed_token_ids_past_vocab": (
        "/v1/completions",
        _json({"prompt": "x", "allowed_token_ids": [10**6]}),
        400,
        "allowed_token_ids",
    ),  # fmt: skip
    "guided_json_without_a_stop_token": (
        "/v1/completions",
        _json({"prompt": "x", "guided_json": {"type": "object"}}),
        400,
        "guided_json",
    ),  # fmt: skip
    "guided_regex_malformed": (
        "/v1/completions",
        _json({"prompt": "x", "guided_regex": "[a-", "stop_token_ids": [5]}),
        400,
        "guided_regex",
    ),  # fmt: skip
    "response_format_schema_missing": (
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}),
        400,
        "response_format",
    ),  # fmt: skip
    "response_format_without_a_stop_token": (
        "/v1/completions",
        _json({"prompt": "x", "response_format": {"type": "json_object"}}),
        400,
        "response_format",
    ),  # fmt: skip
    "response_format_schema_not_compiling": (
        "/v1/completions",
        _json(
            {
                "prompt": "x",
                "stop_token_ids": [5],
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/missing"}}},
            }
        ),
        400,
        "response_format",
    ),  # fmt: skip
    "structured_outputs_regex_malformed": (
        "/v1/completions",
        _json({"prompt": "x", "stop_token_ids": [5], "structured_outputs": {"regex": "[a-"}}),
        400,
        "structured_outputs",
    ),  # fmt: skip
    "response_format_with_ignore_eos": (
        "/v1/completions",
        _json({"prompt": "x", "ignore_eos": True, "response_format": {"type": "json_object"}}),
        400,
        "response_format",
    ),  # fmt: skip
    "two_guides": (
        "/v1/completions",
        _json({"prompt": "x", "guided_regex": "a+", "response_format": {"type": "json_object"}}),
        400,
        None,
    ),  # fmt: skip
    "min_tokens_past_max_tokens": (
        "/v1/completions",
        _json({"prompt": "x", "max_tokens": 2, "min_tokens": 4}),
        400,
        "min_tokens",
    ),  # fmt: skip
    "logit_bias_key_not_an_id": (
        "/v1/completions",
        _json({"prompt": "x", "logit_bias": {"a": 1}}),
        400,
        "logit_bias",
    ),  # fmt: skip
    "logit_bias_key_not_canonical": (
        "/v1/completions",
        _json({"prompt": "x", "logit_bias": {"05": 1}}),
        400,
        "logit_bias",
    ),  # fmt: skip
    "logit_bias_past_100": ("/v1/completions", _json({"prompt": "x", "logit_bias": {"5": 200}}), 400, "logit_bias"),
    "logit_bias_past_vocab": (
        "/v1/completions",
        _json({"prompt": "x", "logit_bias": {"1000000": 1}}),
        400,
        "logit_bias",
    ),  # fmt: skip
    "functions": (
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f", "parameters": {}}]}),
        400,
        "functions",
    ),  # fmt: skip
    "stream_options_without_stream": (
        "/v1/completions",
        _json({"prompt": "x", "stream_options": {}}),
        400,
        "stream_options",
    ),  # fmt: skip
    "logit_bias_key_of_5000_digits": (
        "/v1/completions",
        _json({"prompt": "x", "logit_bias": {"1" * 5000: 1}}),
        400,
        "logit_bias",
    ),  # fmt: skip
    "guided_json_nested_past_pythons_stack": (
        "/v1/completions",
        _json({"prompt": "x", "guided_json": "[" * 5000 + "]" * 5000}),
        400,
        "guided_json",
    ),  # fmt: skip
    "continue_final_message": (
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}),
        400,
        "continue_final_message",
    ),  # fmt: skip
    "chat_template_per_request": (
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}),
        400,
        "chat_template",
    ),  # fmt: skip
    "chat_template_kwargs_setting_messages": (
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}),
        400,
        "chat_template_kwargs",
    ),  # fmt: skip
    "beam_search": ("/v1/completions", _json({"prompt": "x", "use_beam_search": True}), 400, "use_beam_search"),
    "unknown_model": ("/v1/completions", _json({"prompt": "x", "model": "gpt-17"}), 404, "model"),
    "oversized_body": ("/v1/completions", _json({"prompt": "x" * (2 * BODY_LIMIT)}), 413, None),
    "unknown_path": ("/v1/embeddings", _json({"input": "x"}), 404, None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_4xx_and_the_server_keeps_serving(case, plain):
    path, body, status, param = BAD_REQUESTS[case]
    r = httpx.post(plain[0] + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert param in (None, "guided_json") or "guided_json" not in err["message"], err  # (the client's own field)
    assert complete(plain, "still there?", 3)  # the next good request works
    assert wait_idle(plain)["kv_blocks_used"] == 0


def test_unsupported_fields_at_their_no_op_values_are_accepted(plain):
    """OpenAI's defaults of fields the server does not implement change nothing: 200 with the same text."""
    body = {"prompt": "the fox", "max_tokens": 4, "temperature": 0}
    reference = httpx.post(plain[0] + "/v1/completions", json=body).json()["choices"][0]["text"]
    no_ops = {
        "logprobs": False,
        "top_logprobs": 0,
        "logit_bias": {},
        "best_of": 1,
        "stop": [],
        "echo": False,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_tokens": 0,
        "response_format": {"type": "text"},
        "temperature": 1e-5,  # (the least nonzero temperature: as float32 just below 1e-5)
        "use_beam_search": False,
        "spaces_between_special_tokens": True,
    }
    r = httpx.post(plain[0] + "/v1/completions", json=body | no_ops)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference


def test_chat_template_variables_and_generation_prompt_reach_the_template(model_dirs):
    """vLLM's chat fields: chat_template_kwargs are the template's variables, add_generation_prompt opens the
    assistant's turn or not, add_special_tokens overrides the template's choice; the usage counts the prompt so made
    (as /tokenize does), and a template failing on a variable's value is the client's 400."""
    root, _ = model_dirs
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}" \
               "{% if shout %}!{{ shout * 2 }}{% endif %}"  # fmt: skip
    llm, apart = LLM(root / "plain"), LLM(root / "plain")
    msgs = [{"role": "user", "content": "hi"}]
    with running_server(llm, "tiny", max_pending=4, chat_template=template) as server:  # (--chat-template's)

        def used(**fields) -> tuple[int, int]:
            body = {"messages": msgs, "max_tokens": 1, "temperature": 0, **fields}
            r = httpx.post(server[0] + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            tokenized = httpx.post(server[0] + "/tokenize", json={"messages": msgs, **fields})
            return r.json()["usage"]["prompt_tokens"], tokenized.json()["count"]

        def n(text: str, special: bool = True) -> int:
            return len(apart.encode(text, add_special_tokens=special))

        assert used() == (n("hi>"),) * 2
        assert used(add_generation_prompt=False) == (n("hi"),) * 2
        assert used(chat_template_kwargs={"shout": "ab"}) == (n("hi>!abab"),) * 2
        assert used(add_special_tokens=False) == (n("hi>", False),) * 2
        body = {"messages": msgs, "max_tokens": 1, "chat_template_kwargs": {"shout": {"a": 1}}}  # (a dict * 2)
        r = httpx.post(server[0] + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_unknown_paths_and_methods_are_counted(plain):
    def count(status: str) -> float:
        text = httpx.get(plain[0] + "/metrics").text
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "specdec_http_requests_total" and s.labels["status"] == status
        )

    before = count("404"), count("405")
    assert httpx.get(plain[0] + "/nope").status_code == 404
    assert httpx.get(plain[0] + "/v1/completions").status_code == 405
    assert (count("404"), count("405")) == (before[0] + 1, before[1] + 1)


def test_oversized_body_without_content_length_is_cut_off(plain):
    def chunks():  # a generator body goes out chunked: no Content-Length to check up front
        yield b'{"prompt": "'
        for _ in range(4):
            yield b"x" * BODY_LIMIT
        yield b'"}'

    r = httpx.post(plain[0] + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert complete(plain, "still there?", 3)


def test_openai_client_raises_on_4xx(spec):
    c = client(spec)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=name_of(spec), prompt="x", max_tokens=2, temperature=-1)
    assert complete(spec, "ok", 2)


def test_429_beyond_max_pending_then_disconnects_free_the_kv_blocks(plain):
    """Hold max_pending=16 long streams open, the 17th gets 429; dropping the streams aborts them at once."""
    base = health(plain)
    body = {"prompt": "hold the line", "max_tokens": LONG, "temperature": 0, "stream": True}
    http = httpx.Client(base_url=plain[0], timeout=60)
    streams = []
    with gated_steps(plain) as gate:  # the engine steps only while a stream waits for its first delta
        try:
            for _ in range(16):
                cm = http.stream("POST", "/v1/completions", json=body)
                gate.set()
                resp = cm.__enter__()
                assert resp.status_code == 200
                lines = resp.iter_lines()  # kept alive: dropping it would close the response
                assert next(lines).startswith("data: ")  # the request is running: its first delta arrived
                gate.clear()
                streams.append((cm, lines))
            h = health(plain)
            assert h["num_requests_in_flight"] == 16 and h["kv_blocks_used"] > 0
            r = httpx.post(plain[0] + "/v1/completions", json={"prompt": "one more", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        finally:
            for cm, _ in streams:
                cm.__exit__(None, None, None)  # closes the connection mid-stream: a client disconnect
            http.close()
    h = wait_idle(plain)
    assert h["kv_blocks_used"] == 0 and h["num_requests_in_flight"] == 0
    assert h["num_requests_finished"]["abort"] - base["num_requests_finished"]["abort"] == 16
    assert h["num_generated_tokens"] - base["num_generated_tokens"] < 16 * (LONG)  # cut short, not finished
    assert complete(plain, "after the storm", 3)


@contextlib.contextmanager
def gated_steps(server):
    """The server's engine steps only while the yielded Event is set (it starts cleared; set on exit), and then only
    to admit a waiting request: one step per new request, however fast the engine is or how long a request takes to
    arrive, so a test holds requests running for as long as it needs instead of racing the wall clock (a 16-token
    plain chain per step ran a stream to its max_tokens when a slow window let ~60 steps through)."""
    engine = server[1].state.engine.engine  # the Engine the server's loop thread steps
    gate, real_step = threading.Event(), engine.step

    def step():
        if gate.wait(30) and engine.waiting:
            return real_step()
        time.sleep(1e-3)  # (nothing to admit: the loop thread polls its commands, an add among them, and comes back)
        return []

    engine.step = step
    try:
        yield gate
    finally:
        gate.set()
        del engine.step


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_aborts_every_choice(plain, n, stream):
    """A client that gives up on a request aborts it, each of its n choices (the engine is held until the client
    has gone)."""
    base = health(plain)["num_requests_finished"]["abort"]
    body = {"prompt": "slow", "max_tokens": LONG, "temperature": 0, "n": n, "stream": stream}
    with gated_steps(plain), pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", plain[0] + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3)) as r:
            for _ in r.iter_lines():  # (a stream sends its role-less first chunks only once a step ran)
                pass
    h = wait_idle(plain)
    assert h["num_requests_finished"]["abort"] == base + n and h["kv_blocks_used"] == 0


def http_count(server, endpoint: str, status: int) -> float:
    """``specdec_http_requests_total{endpoint, status}`` now (0 before the first)."""
    for fam in text_string_to_metric_families(httpx.get(server[0] + "/metrics").text):
        for s in fam.samples:
            if s.name == "specdec_http_requests_total" and s.labels == {"endpoint": endpoint, "status": str(status)}:
                return s.value
    return 0.0


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("n", [1, 3])
def test_a_client_that_stops_reading_then_leaves_aborts_its_stream(plain, n, spec_version):
    """A client that stopped reading (the server's write of a chunk blocks) and then disconnects aborts every choice
    at once, and the stream counts as 499: Starlette cancels the blocked write (ASGI 2.3: on the disconnect message;
    2.4: the write raises ``OSError``) without closing the events' iterator, whose cleanup would otherwise wait for
    the garbage collector (off here) while the request decodes to its end. Driven at the ASGI level, where a write
    can block for certain. The engine steps only to admit the choices
    (``gated_steps``' gate left open never blocks the loop thread, which takes the aborts between steps), so none
    ends by length."""
    import gc

    app, engine = plain[1], plain[1].state.engine
    base, base_499 = health(plain)["num_requests_finished"]["abort"], http_count(plain, "completions", 499)
    body = json.dumps({"prompt": "slow", "max_tokens": LONG, "temperature": 0, "n": n, "stream": True}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": headers}  # fmt: skip

    async def run() -> None:
        blocked, gone, requests = asyncio.Event(), asyncio.Event(), [{"type": "http.request", "body": body}]

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":  # the first chunk: the client reads no more
                blocked.set()
                await gone.wait()
                if spec_version == "2.4":
                    raise OSError("the client left")
                await asyncio.Event().wait()

        served = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.wait_for(blocked.wait(), 30)
        gone.set()
        with contextlib.suppress(ClientDisconnect):  # (2.4: Starlette's word for the failed write)
            await asyncio.wait_for(served, 30)
        for _ in range(600):  # (a hang guard: the aborts land at the engine's next command)
            if engine.num_in_flight == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.num_in_flight == 0  # (here: asyncio.run's own cleanup would close the iterator)

    gc.disable()
    try:
        with gated_steps(plain) as gate:
            gate.set()
            asyncio.run(run())
    finally:
        gc.enable()
    h = wait_idle(plain)
    assert h["num_requests_finished"]["abort"] == base + n and h["kv_blocks_used"] == 0
    assert http_count(plain, "completions", 499) == base_499 + 1


# --- metrics and load --------------------------------------------------------------------------------------------


def test_metrics_show_acceptance(spec):
    complete(spec, "def fib(n):", 16)
    long = list(range(5, 80))  # 75 tokens: served twice, the second time 64 of them from the prefix cache
    cached = health(spec)["num_cached_prompt_tokens"]
    for _ in range(2):
        client(spec).completions.create(model=name_of(spec), prompt=long, max_tokens=2, temperature=0)
    assert health(spec)["num_cached_prompt_tokens"] == cached + 64
    text = httpx.get(spec[0] + "/metrics").text
    samples = {s.name + json.dumps(s.labels, sort_keys=True): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip

    def value(name, **labels):
        return samples[name + json.dumps(labels, sort_keys=True)]

    drafted = value("specdec_spec_decode_num_drafted_tokens_total")
    accepted = value("specdec_spec_decode_num_accepted_tokens_total")
    steps = value("specdec_spec_decode_num_steps_total")
    assert 0 < drafted <= 3 * steps and 0 < accepted <= drafted  # gamma = 3, or less where a controller chose so
    assert value("specdec_spec_decode_acceptance_rate") == pytest.approx(accepted / drafted)
    assert accepted / drafted > 0.5  # the draft has the target's weights
    assert value("specdec_spec_decode_accepted_length_count") == steps
    assert value("specdec_spec_decode_accepted_length_sum") == accepted
    assert value("specdec_spec_decode_accepted_length_bucket", le="+Inf") == steps
    assert value("specdec_spec_decode_mean_accepted_length") == pytest.approx((accepted + steps) / steps)
    # the chosen depth per request and step: every decoding step counted once, drafted tokens as its sum
    assert value("specdec_spec_decode_depth_count") == steps
    assert value("specdec_spec_decode_depth_sum") == drafted
    assert 0 <= value("specdec_spec_decode_depth_last") <= 3
    assert value("specdec_spec_decode_adaptive") in (0.0, 1.0)
    assert value("specdec_generation_tokens_total") > 0 and value("specdec_prompt_tokens_total") > 0
    assert value("specdec_prompt_tokens_cached_total") >= 64
    assert value("specdec_num_preemptions_total") == 0  # (a cache with room for every request)
    assert value("specdec_http_requests_total", endpoint="completions", status="200") >= 1
    assert value("specdec_kv_cache_blocks_total") > 0
    for gauge in ("specdec_num_requests_running", "specdec_num_requests_waiting", "specdec_kv_cache_usage_ratio"):
        assert gauge + "{}" in samples


def test_bounded_load_run_completes_and_frees_kv(spec):
    c, model = client(spec), name_of(spec)
    base = health(spec)

    def one(i: int):
        kw = dict(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8, temperature=0.8, seed=i)
        if i % 2:
            chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            return chunks[-1].usage.completion_tokens, [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        out = c.completions.create(**kw)
        return out.usage.completion_tokens, out.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(64)))
    assert results == [(8, "length")] * 64
    h = wait_idle(spec)
    assert h["kv_blocks_used"] == 0 and h["num_requests_waiting"] == 0 and h["num_requests_in_flight"] == 0
    assert h["num_requests_finished"]["length"] - base["num_requests_finished"]["length"] == 64


# --- the backend API without HTTP ----------------------------------------------------------------------------------


def test_async_engine_api(spec):
    engine = spec[1].state.engine

    async def run():
        with pytest.raises(ValueError):  # invalid input raises before anything streams
            await engine.add_request([1, 2, 3], SamplingParams(max_tokens=CONTEXT))
        stream = await engine.add_request("hello world", SamplingParams(max_tokens=5))
        deltas = [d async for d in stream]
        assert deltas[-1].finished and deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 5
        assert sum(len(d.token_ids) for d in deltas) == 5 and deltas[-1].metrics["num_steps"] >= 1
        # abort mid-stream: the request ends with "abort" and its blocks come back
        stream = await engine.add_request("hello world", SamplingParams(max_tokens=LONG))
        first = await stream.__anext__()
        engine.abort(stream.request_id)
        rest = [d async for d in stream]
        assert not first.finished and rest[-1].finish_reason == "abort"

    asyncio.run(run())
    assert wait_idle(spec)["kv_blocks_used"] == 0


def test_incremental_text_never_splits_a_character(spec, model_dirs):
    """Byte-level tokens cut multi-byte characters: each delta holds a trailing U+FFFD back until it resolves."""
    from spec_engine.server.async_engine import _Sink

    text = "naïve 日本語 🙂!"
    ids = model_dirs[1].encode(text).ids
    assert len(ids) > len(text)  # several characters span more than one token
    engine, sink = spec[1].state.engine, _Sink(None, None, 0)
    pieces = [engine._new_text(sink, ids[:k], finished=k == len(ids)) for k in range(1, len(ids) + 1)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_a_template_that_does_not_compile_leaves_the_llm_unserved(tmp_path, model_dirs):
    root, _ = model_dirs
    shutil.copytree(root / "plain", tmp_path / "broken")
    (tmp_path / "broken" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    llm = LLM(tmp_path / "broken")
    with pytest.raises(ValueError, match="chat template"):
        create_app(llm, "broken")
    assert llm.served_by is None and llm.generate("the fox", SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_served_llm_refuses_direct_calls(model_dirs):
    """While an AsyncEngine steps an LLM's engine in its thread, LLM.generate (another thread stepping the same
    engine) and a second AsyncEngine are refused; after close both work again."""
    from spec_engine.server.async_engine import AsyncEngine

    root, _ = model_dirs
    llm = LLM(root / "plain")
    served = AsyncEngine(llm)
    with pytest.raises(RuntimeError, match="served"):
        llm.generate("the fox", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RuntimeError, match="already served"):
        AsyncEngine(llm)
    served.close()
    assert llm.generate("the fox", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    AsyncEngine(llm).close()
