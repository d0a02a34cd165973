"""Structured outputs (``guided_json``, ``guided_regex``, ``guided_grammar``; ``spec_engine.structured``): greedy
tokens are a step-by-step reference's (HF's forward, each step masked by its own llguidance matcher fed the tokens so
far), with every drafter, each tree node masked under its own path; sampled outputs follow the masked target's exact
distribution (chi2 over every sentence of a finite language); a planted bug (nodes masked as if their drafted path
were not there) is caught; malformed guides are refused before anything queues."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from tiny_models import DRAFTER_MODES, drafter_config, make_model, make_noisy_copy, make_tokenizer

import spec_engine.logits_processors as processors
import spec_engine.structured as structured
from spec_engine import LLM, SamplingParams

llg = pytest.importorskip("llguidance")

END = "<|end|>"  # the tokenizer's one special token: the models' EOS
VOCAB = 320  # the models' rows: the BPE's 300 tokens, END, and ids no text reaches
MAX_TOKENS = 24
PROMPT = "the quick brown fox"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "w": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}},
    "required": ["n", "w"],
    "additionalProperties": False,
}  # fmt: skip
GUIDES = {
    "regex": dict(guided_regex=r"[a-z]{2,6}( [a-z]{1,5}){1,2}\."),
    "json": dict(guided_json=SCHEMA, disable_any_whitespace=True),
    "grammar": dict(guided_grammar='start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    tok = make_tokenizer(root / "target")
    tok.add_special_tokens([END])
    tok.save(str(root / "target" / "tokenizer.json"))
    eos = tok.token_to_id(END)
    target = make_model(root / "target", "llama_gqa", vocab_size=VOCAB, logit_scale=4.0, eos_token_id=eos)
    return target, make_noisy_copy(target, root / "draft", noise=0.1), tok


def fresh_matcher(tok, guide: dict):
    """A matcher of its own for the reference, straight from llguidance (not through ``Grammars``)."""
    ll = llg.LLTokenizer(tok.to_str(), n_vocab=VOCAB, eos_token=tok.token_to_id(END))
    if "guided_json" in guide:
        flexible = {"whitespace_flexible": not guide.get("disable_any_whitespace", False)}
        text = llg.LLMatcher.grammar_from_json_schema(guide["guided_json"], defaults=flexible)
    elif "guided_regex" in guide:
        text = llg.LLMatcher.grammar_from_regex(guide["guided_regex"])
    else:
        text = llg.LLMatcher.grammar_from_lark(guide["guided_grammar"])
    return llg.LLMatcher(ll, text, log_level=0)


def masked(z: torch.Tensor, matcher, eos: int) -> torch.Tensor:
    """``z`` [V] with the tokens the grammar does not allow next at -inf; EOS allowed where the output is whole."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:VOCAB]
    allowed = torch.from_numpy(bits.astype(bool))
    allowed[eos] = matcher.is_accepting()
    return z.masked_fill(~allowed, float("-inf"))


def reference_greedy(model_dir, tok, prompt: list[int], guide: dict, n: int) -> tuple[list[int], int]:
    """Greedy tokens one forward a token, each step masked by a matcher fed the output so far (up to and with EOS),
    and how many are trustworthy (a top-2 margin >= 1e-3: a near-tie may go either way in another summation order)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    matcher, eos = fresh_matcher(tok, guide), tok.token_to_id(END)
    seq, trusted = list(prompt), n
    for i in range(n):
        with torch.no_grad():
            z = masked(model(torch.tensor([seq])).logits[0, -1].float(), matcher, eos)
        top2 = z.topk(2).values
        if trusted == n and top2[0] - top2[1] < 1e-3:
            trusted = i + 1
        seq.append(int(z.argmax()))
        if seq[-1] == eos:
            return seq[len(prompt) :], min(trusted, i + 1)
        assert matcher.consume_token(seq[-1])
    return seq[len(prompt) :], trusted


def follows(guide: dict, text: str) -> bool:
    """Whether a finished output is a sentence of the guide's language (checked without llguidance)."""
    if "guided_regex" in guide:
        return re.fullmatch(guide["guided_regex"], text) is not None
    if "guided_json" in guide:
        value = json.loads(text)
        return set(value) == {"n", "w"} and isinstance(value["n"], int) and len(value["w"]) <= 2
    return re.fullmatch(r"x=[0-9]{1,3}(,[0-9]{1,3})*", text) is not None


@pytest.mark.parametrize("guide", list(GUIDES))
@pytest.mark.parametrize("mode", list(DRAFTER_MODES))
def test_greedy_tokens_match_the_reference(pair, mode, guide):
    target, draft, tok = pair
    llm = LLM(str(target), speculative_config=drafter_config(mode, draft), max_model_len=128, dtype="float32")
    prompt = tok.encode(PROMPT).ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=MAX_TOKENS, **GUIDES[guide]),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    ref, trusted = reference_greedy(target, tok, prompt, GUIDES[guide], MAX_TOKENS)
    assert out.token_ids[:trusted] == ref[:trusted]
    if out.finish_reason == "stop":
        assert follows(GUIDES[guide], out.text), out.text


def test_a_model_that_agrees_finishes_each_guide(pair):
    """The target drafting for itself (every drafted token accepted) ends each guide's sentence with EOS inside
    MAX_TOKENS, so the checks above see whole sentences too; the same tokens as plain decoding."""
    target, _, tok = pair
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4}
    fast, plain = (LLM(str(target), speculative_config=s, max_model_len=128, dtype="float32") for s in (spec, None))
    for guide in GUIDES.values():
        params = SamplingParams(max_tokens=64, **guide)
        got, want = (m.generate(PROMPT, params, use_tqdm=False)[0].outputs[0] for m in (fast, plain))
        assert got.token_ids == want.token_ids and got.finish_reason == "stop" and follows(guide, got.text), got.text
    assert fast.engine.stats["num_accepted"] > 0


FINITE = r"(ab|b|ba)[a-c]?"  # a finite language: every token sequence it allows is enumerated below


def sentences(tok, matcher, eos: int, prefix: list[int]):
    """Every token sequence the matcher accepts from its state, each ending with EOS."""
    out = [prefix + [eos]] if matcher.is_accepting() else []
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:VOCAB]
    for t in np.flatnonzero(bits).tolist():
        if t != eos:
            assert matcher.consume_token(t)
            out += sentences(tok, matcher, eos, prefix + [t])
            matcher.rollback(1)
    return out


def test_sampled_outputs_follow_the_exact_distribution(pair):
    """Sampled rows (temperature 1, a draft model at depth 3) emit each token sequence of a finite language with its
    exact probability under the masked target: the product of its steps' masked softmax (chi2, 600 seeded
    requests)."""
    from test_engine_sampling import chi2_pvalue
    from transformers import AutoModelForCausalLM

    target, draft, tok = pair
    guide, eos = dict(guided_regex=FINITE), tok.token_to_id(END)
    prompt = tok.encode(PROMPT).ids
    seqs = sentences(tok, fresh_matcher(tok, guide), eos, [])
    assert 6 <= len(seqs) <= 200
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    probs = []
    for seq in seqs:
        matcher, p = fresh_matcher(tok, guide), 1.0
        for j, t in enumerate(seq):
            with torch.no_grad():
                z = model(torch.tensor([prompt + seq[:j]])).logits[0, -1]
            p *= torch.softmax(masked(z, matcher, eos), dim=-1)[t].item()
            if t != eos:
                matcher.consume_token(t)
        probs.append(p)
    assert abs(sum(probs) - 1) < 1e-9
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft),
              "num_speculative_tokens": 3}, max_model_len=128, dtype="float32", max_num_seqs=64)  # fmt: skip
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, **guide) for s in range(600)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 600, params, use_tqdm=False)
    counts = np.zeros(len(seqs))
    for o in outs:
        counts[seqs.index(o.outputs[0].token_ids)] += 1  # (a sequence off the language: ValueError here)
    assert chi2_pvalue(counts, np.array(probs)) > 1e-3, (counts, probs)
    assert llm.engine.stats["num_accepted"] > 0


SENTENCES = {"regex": "abc de.", "json": '{"n":12,"w":["ab","c"]}', "grammar": "x=1,23,4"}


def tree_logits(pair, guide: str, planted: bool, monkeypatch):
    """One row's tree after part of a sentence of the guide: the root, a chain of the sentence's next 4 tokens, and
    a branch off the grammar under the root; (logits processed by ``process_logits_``, by the reference)."""
    from spec_engine.request import Request
    from spec_engine.structured import Grammars

    _, _, tok = pair
    eos = tok.token_to_id(END)
    params = SamplingParams(max_tokens=32, **GUIDES[guide])
    ids = tok.encode(SENTENCES[guide]).ids
    assert len(ids) >= 6
    req = Request("r", tok.encode(PROMPT).ids, params, seed=0, stop_ids=frozenset([eos]))
    req.grammar = Grammars(tok, VOCAB, [eos]).state(params)
    req.append(ids[:2])  # the output so far (the root last)
    off = next(t for t in range(VOCAB) if fresh_matcher(tok, GUIDES[guide]).try_consume_tokens(ids[:2] + [t]) < 3)
    drafted, parents = ids[2:6] + [off], [-1, 0, 1, 2, 3, 0]  # nodes 1-4: the chain; node 5: off the grammar
    z = torch.randn(1, len(parents), VOCAB, generator=torch.Generator().manual_seed(0))
    if planted:  # every node masked as if its drafted path were not there
        monkeypatch.setattr(processors, "node_paths", lambda parents: [[] for _ in parents])
    got = processors.process_logits_(z.clone(), torch.tensor([[ids[1]] + drafted]), torch.tensor([parents]), [req])
    want = z.clone()
    for t in range(5):  # the root and the chain: masked after the output and the path; node 5 left as it is
        matcher = fresh_matcher(tok, GUIDES[guide])
        assert matcher.consume_tokens(ids[: 2 + t])
        want[0, t] = masked(z[0, t], matcher, eos)
    return got, want


@pytest.mark.parametrize("guide", list(GUIDES))
def test_each_node_is_masked_under_its_own_path(pair, guide, monkeypatch):
    got, want = tree_logits(pair, guide, False, monkeypatch)
    assert torch.equal(got, want)
    got, want = tree_logits(pair, guide, True, monkeypatch)
    assert not torch.equal(got, want)  # the planted bug is caught


def test_a_planted_bug_is_caught_end_to_end(pair, monkeypatch):
    """Masking every node as if its drafted path were not there lets a draft that agrees with the target emit a
    token the grammar forbids there: the request fails (its output left the grammar)."""
    target, _, tok = pair
    monkeypatch.setattr(processors, "node_paths", lambda parents: [[] for _ in parents])
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(target),
              "num_speculative_tokens": 4}, max_model_len=128, dtype="float32")  # fmt: skip
    with pytest.raises(RuntimeError, match="left its grammar"):
        llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, **GUIDES["regex"]), use_tqdm=False)


@pytest.mark.parametrize("bad", [
    dict(guided_json="{not json"), dict(guided_json=[1]), dict(guided_regex="  "), dict(guided_grammar=5),
    dict(guided_regex="a", guided_json={"type": "object"}), dict(guided_regex="a", guided_choice=["a"]),
    dict(guided_regex="a", ignore_eos=True), dict(guided_json={"type": "object"}, min_tokens=2),
    dict(guided_grammar='start: "a"', allowed_token_ids=[1]), dict(guided_regex="a", bad_words=["b"]),
    dict(guided_regex="a" * 70000), dict(guided_json={"enum": {1, 2}}),
    dict(guided_json="[" * 20000 + "]" * 20000),  # (nesting past Python's stack: a ValueError, not a RecursionError)
])  # fmt: skip
def test_malformed_guides_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_guides_that_do_not_compile_are_refused_before_queueing(pair, monkeypatch):
    target, _, tok = pair
    llm = LLM(str(target), max_model_len=128, dtype="float32")
    for guide, name in (
        (dict(guided_regex="[a-"), "guided_regex"),
        (dict(guided_grammar="start: nothing"), "guided_grammar"),
        (dict(guided_json={"type": "nonsense"}), "guided_json"),
        (dict(guided_regex=r"[^\s\S]"), "guided_regex"),
    ):  # an empty language
        with pytest.raises(ValueError, match=name):
            llm.engine.add_request([1, 2], SamplingParams(max_tokens=4, **guide))
    assert not llm.engine.waiting
    monkeypatch.setattr(structured, "_llguidance", lambda: (_ for _ in ()).throw(ValueError(structured.INSTALL_HINT)))
    fresh = LLM(str(target), max_model_len=128, dtype="float32")
    with pytest.raises(ValueError, match="pip install"):
        fresh.engine.add_request([1, 2], SamplingParams(max_tokens=4, guided_regex="b+"))


def test_required_tool_calls_keep_their_tools_definitions(pair):
    """tool_choice "required" nests each tool's parameters in one array schema: their "#/$defs/..." references
    still resolve (the definitions move to its root), and a name two tools define differently is refused."""
    from spec_engine.server.tools import tool_schema

    target, _, _ = pair
    llm = LLM(str(target), max_model_len=128, dtype="float32")
    loc = {"type": "object", "properties": {"city": {"type": "string"}}}

    def tool(name, defs):
        params = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"], "$defs": defs}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    schema = tool_schema([tool("f", {"Loc": loc}), tool("g", {"Loc": loc})], "required", True)
    assert schema["$defs"] == {"Loc": loc}
    llm.engine.grammars.check(SamplingParams(max_tokens=8, guided_json=schema))  # compiles
    with pytest.raises(ValueError, match="Loc"):
        tool_schema([tool("f", {"Loc": loc}), tool("g", {"Loc": {"type": "string"}})], "required", True)


def test_nodes_verification_never_reaches_are_left_alone(pair):
    """A stop token the grammar takes as text is held back until the output is whole; a drafted node below a token
    its parent masked (here the ngram drafter's x after z) or below a stop token is never judged, so it is not
    masked (and cannot fail the request): the same tokens as plain decoding."""
    target, _, tok = pair
    x, z = tok.token_to_id("x"), tok.token_to_id("z")
    prompt = {"prompt_token_ids": [z, x] * 6 + [z]}
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        llm = LLM(str(target), speculative_config=spec, max_model_len=128, dtype="float32")
        params = SamplingParams(max_tokens=8, guided_regex="xx|z|zxx", stop_token_ids=[x])
        outs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0])
    assert outs[0].token_ids == outs[1].token_ids and outs[1].token_ids[0] == z and outs[1].finish_reason == "stop"


def test_the_tokens_a_grammar_forces_are_drafted(pair):
    """Where the grammar allows one way on (a fixed run of text), the row's view carries its tokens and suffix
    speculation drafts them as a sure chain: most are accepted (the target may still pick another tokenization of
    the same text), and the tokens are plain decoding's."""
    target, _, tok = pair
    guide = dict(guided_regex="zebra yak xylophone walrus [a-z]{2,5}\\.")  # (none of it in the prompt)
    outs, stats = [], []
    for spec in (None, {"method": "suffix", "num_speculative_tokens": 8}):
        llm = LLM(str(target), speculative_config=spec, max_model_len=128, dtype="float32")
        outs.append(llm.generate(PROMPT, SamplingParams(max_tokens=32, **guide), use_tqdm=False)[0].outputs[0])
        stats.append(llm.engine.stats)
    assert outs[0].token_ids == outs[1].token_ids and outs[1].text.startswith("zebra yak xylophone walrus ")
    assert stats[1]["num_accepted"] >= 4 and stats[1]["num_steps"] < stats[0]["num_steps"], stats


def test_forced_tokens_follow_the_output(pair):
    from spec_engine.structured import Grammars

    _, _, tok = pair
    eos = tok.token_to_id(END)
    params = SamplingParams(guided_regex="ab(cd|ce)fgh")
    state = Grammars(tok, VOCAB, [eos]).state(params)
    ids = tok.encode("abcdfgh").ids
    for k in range(len(ids) + 1):
        ref = fresh_matcher(tok, {"guided_regex": "ab(cd|ce)fgh"})
        assert ref.consume_tokens(ids[:k])
        assert state.forced(ids[:k], 16) == tuple(ref.compute_ff_tokens()[:16])
    fresh = Grammars(tok, VOCAB, [eos]).state(params)
    assert len(fresh.forced([], 16)) >= 1 and fresh.forced([], 1) == fresh.forced([], 16)[:1]


def test_gbnf_grammars_are_read(pair):
    target, _, _ = pair
    llm = LLM(str(target), max_model_len=128, dtype="float32")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, guided_grammar='root ::= "yes" | "no"'), use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no") and out[0].outputs[0].finish_reason == "stop"


def test_a_grammar_past_llguidances_limits_is_refused():
    """One that compiles but fails at its first mask (the embedded target's 4,096-token vocabulary), refused with
    llguidance's reason in one line."""
    from spec_engine import default_model_paths
    from spec_engine.llm import load_tokenizer
    from spec_engine.structured import Grammars

    grammars = Grammars(load_tokenizer(default_model_paths()[0]), 4096)
    with pytest.raises(
        ValueError, match="guided_regex does not compile: lexer error: too many expressions constructed$"
    ):
        grammars.check(SamplingParams(guided_regex="[a-z]{0,3}(x|y){0,1}" * 40))


def test_a_model_without_a_tokenizer_or_a_stop_token_says_so(tmp_path):
    bare = LLM(str(make_model(tmp_path / "bare", "llama_gqa", vocab_size=VOCAB)), max_model_len=128, dtype="float32")
    with pytest.raises(ValueError, match="tokenizer"):
        bare.engine.add_request([1, 2], SamplingParams(max_tokens=4, guided_regex="a"))
    make_tokenizer(tmp_path / "no_eos")
    target = make_model(tmp_path / "no_eos", "llama_gqa", vocab_size=VOCAB, eos_token_id=None)
    llm = LLM(str(target), max_model_len=128, dtype="float32")
    with pytest.raises(ValueError, match="stop token"):
        llm.engine.add_request([1, 2], SamplingParams(max_tokens=4, guided_regex="a"))
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, guided_regex="ab?", stop_token_ids=[299]), use_tqdm=False)
    assert out[0].outputs[0].text in ("a", "ab")


def test_a_grammar_that_needs_a_stop_token_fails_its_request_alone(pair):
    """A stop token the grammar needs as text (here the only one it allows) fails that request with a reason;
    a request beside it decodes as it would alone."""
    target, _, tok = pair
    llm = LLM(str(target), max_model_len=128, dtype="float32")
    x = tok.token_to_id("x")
    ids = tok.encode(PROMPT).ids
    failing = llm.engine.add_request(ids, SamplingParams(max_tokens=6, guided_regex="xx", stop_token_ids=[x]))
    beside = llm.engine.add_request(ids, SamplingParams(max_tokens=6))
    while llm.engine.has_unfinished():
        llm.engine.step()
    alone = llm.generate(PROMPT, SamplingParams(max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert failing.finish_reason == "error" and "stop tokens" in failing.error, failing.error
    assert beside.finish_reason == "length" and beside.output_token_ids == alone.token_ids


def test_smollm2_json_is_the_same_with_the_hybrid_default(smollm2):
    """The real model: a JSON schema's answer is valid JSON, token for token plain decoding's."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    msgs = [{"role": "user", "content": "Describe a person named Ada, aged 36, as JSON."}]
    params = SamplingParams(max_tokens=64, guided_json=schema)
    outs = [LLM(smollm2, speculative_config=s).chat(msgs, params, use_tqdm=False)[0].outputs[0]
            for s in ({"method": "hybrid"}, None)]  # fmt: skip
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].finish_reason == "stop" and set(json.loads(outs[0].text)) == {"name", "age"}, outs[0].text


def test_objects_that_name_their_properties_take_no_other_keys(pair):
    """vLLM's default backend (xgrammar, strict) reads an object schema with ``properties`` and no word on other keys
    as closed; JSON Schema's own default would let a weak model wander into keys the schema never named."""
    _, _, tok = pair
    ll = llg.LLTokenizer(tok.to_str(), n_vocab=VOCAB, eos_token=tok.token_to_id(END))

    def accepts(schema, text: str) -> bool:
        text_of_grammar = structured.grammar_text("guided_json", schema, whitespace_flexible=False)
        matcher = llg.LLMatcher(ll, text_of_grammar, log_level=0)
        ids = tok.encode(text).ids
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    named = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert accepts(named, '{"n":1}') and not accepts(named, '{"n":1,"w":2}')
    assert accepts({**named, "additionalProperties": True}, '{"n":1,"w":2}')
    assert accepts({"type": "object"}, '{"n":1,"w":2}')  # an object naming no properties stays free


def test_closed_objects_edits_subschemas_only():
    leaf = {"type": "object", "properties": {"a": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {"p": dict(leaf), "q": {"type": "array", "items": dict(leaf)}},
        "$defs": {"d": {"anyOf": [dict(leaf), {"type": "null"}]}},
        "const": {"type": "object", "properties": {}},  # data, not a schema
        "patternProperties": {"^x": {"type": "object", "properties": {}, "additionalProperties": True}},
    }
    before = json.dumps(schema)
    out = structured.closed_objects(schema)
    assert json.dumps(schema) == before, "the caller's schema was edited"
    assert "additionalProperties" not in out  # (patternProperties say which other keys it takes)
    assert out["properties"]["p"]["additionalProperties"] is False
    assert out["properties"]["q"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert out["const"] == {"type": "object", "properties": {}}
    assert out["patternProperties"]["^x"]["additionalProperties"] is True
    branches = {"allOf": [leaf, {"properties": {"b": {"type": "string"}}}]}  # closing each would refuse the other's
    assert structured.closed_objects(branches) == branches
