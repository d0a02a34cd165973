"""Chat: ``LLM.chat`` (vLLM's signature), ``specdec generate --chat`` and the server's chat endpoint render the
model's own template (HF directory or GGUF metadata) and encode it without adding special tokens twice."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jinja2
import pytest
from gguf_files import chatml_tokenizer, tokenizer_metadata, write_gguf
from tiny_models import make_model, serve_in_thread

from spec_engine import LLM, SamplingParams
from spec_engine.cli import main
from spec_engine.server.app import create_app

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = 1, 2
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello 2024, café?"}]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The same tiny checkpoint as an HF directory (tokenizer.json, tokenizer_config.json's template) and as a GGUF
    file (tokenizer and template in its metadata, BOS added by the tokenizer)."""
    root = tmp_path_factory.mktemp("chat")
    tok = chatml_tokenizer(SPECIALS)
    hf = make_model(root / "hf", "llama_gqa", vocab_size=tok.get_vocab_size(), logit_scale=4.0,
                    tokenizer_config={"chat_template": CHATML, "bos_token": "<|im_start|>"})  # fmt: skip
    tok.save(str(hf / "tokenizer.json"))
    meta = {**tokenizer_metadata(tok, SPECIALS, pre="smollm"), "bos": BOS, "eos": EOS, "add_bos": True}
    return {"hf": hf, "gguf": write_gguf(root / "m.gguf", hf, "F32", tokenizer=meta, chat_template=CHATML), "tok": tok}


@pytest.fixture(scope="module", params=["hf", "gguf"])
def llm(request, models) -> LLM:
    return LLM(model=str(models[request.param]), dtype="float32", max_model_len=128)


def _expected(models, messages, add_generation_prompt=True, template=CHATML) -> tuple[str, list[int]]:
    text = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<|im_start|>")  # fmt: skip
    return text, models["tok"].encode(text).ids  # the HF tokenizer adds no specials of its own


def test_chat_renders_the_model_template(llm, models):
    text, ids = _expected(models, MESSAGES)
    out = llm.chat(MESSAGES, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == text and out[0].prompt_token_ids == ids
    assert ids[:2] == [BOS, BOS] and ids[2] != BOS  # the template's BOS and <|im_start|>; add_bos adds no other
    plain = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    assert out[0].outputs[0].token_ids == plain.outputs[0].token_ids


def test_chat_batch_override_and_no_generation_prompt(llm, models):
    other = [{"role": "user", "content": "naïve 日本語 🙂"}]
    outs = llm.chat([MESSAGES, other], [GREEDY, SamplingParams(max_tokens=3, temperature=0.0)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [_expected(models, MESSAGES)[1], _expected(models, other)[1]]
    assert len(outs[1].outputs[0].token_ids) <= 3
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    out = llm.chat(other, GREEDY, use_tqdm=False, chat_template=template, add_generation_prompt=False)[0]
    assert out.prompt == "[user] naïve 日本語 🙂\n"
    assert out.prompt_token_ids == llm.encode(out.prompt, add_special_tokens=False)
    with pytest.raises(ValueError, match="messages"):
        llm.chat(["not a message"], GREEDY)


def test_cli_generate_chat(models, capsys):
    args = ["generate", "--model", str(models["gguf"]), "--chat", "hello 2024, café?", "--max-tokens", "4",
            "--method", "none", "--dtype", "float32"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    llm = LLM(model=str(models["gguf"]), dtype="float32", max_model_len=128)
    want = llm.chat([{"role": "user", "content": "hello 2024, café?"}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert printed.startswith(want[0].outputs[0].text + "\n[specdec] ")  # the reply alone, then the stats line


def test_server_chat_uses_the_gguf_template(models):
    llm = LLM(model=str(models["gguf"]), dtype="float32", max_model_len=128)
    with serve_in_thread(create_app(llm, "tiny-gguf"), log_level="warning") as port:
        body = {"model": "tiny-gguf", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert json.loads(r.text)["usage"]["prompt_tokens"] == len(_expected(models, MESSAGES)[1])


def test_chat_hands_tools_and_earlier_calls_to_the_template(llm):
    """LLM.chat's ``tools`` (vLLM's) are the template's ``tools``; an earlier call's arguments reach it parsed."""
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}<{{ m.role }}>"
                "{{ m.content }}{% for c in m.tool_calls or [] %}({{ c.function.arguments.a }}){% endfor %}"
                "{% endfor %}")  # fmt: skip
    tools = [{"type": "function", "function": {"name": "add"}}, {"type": "function", "function": {"name": "mul"}}]
    messages = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}]  # fmt: skip
    out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template, tools=tools)
    assert out[0].prompt == "[add][mul]<user>2 + 3?<assistant>(2)"


def test_templates_render_transformers_helpers():
    """What transformers gives templates: ``strftime_now``, the ``{% generation %}`` block (its body as written),
    ``tojson`` with its keyword arguments (``sort_keys``, ``separators``: the prompt text, so the tokens, as HF's)."""
    import datetime

    from spec_engine.chat_template import ChatTemplate

    source = ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}|"
              "{{ strftime_now('%Y') }}|{{ {'b': 1, 'a': [2]} | tojson(sort_keys=True, separators=(',', ':')) }}|"
              "{{ 'é' | tojson }}")  # fmt: skip
    before = datetime.datetime.now().year
    text = ChatTemplate(None, source=source).render([{"role": "user", "content": "hi"}])
    years = {before, datetime.datetime.now().year}  # (a render across New Year's midnight writes either)
    assert text in {f'hi|{y}|{{"a":[2],"b":1}}|"é"' for y in years}, text


def test_malformed_conversations_are_refused(models):
    llm = LLM(model=str(models["hf"]), dtype="float32", max_model_len=128)
    for bad in ([], [[]], [{"role": "user"}], [{"content": "x"}], [{"role": 1, "content": "x"}], [[1]]):
        with pytest.raises(ValueError, match="messages must be a non-empty list"):
            llm.chat(bad, use_tqdm=False)
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls},
               {"role": "tool", "tool_call_id": "c", "content": "1"}]  # fmt: skip
    assert llm.chat(history, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_content_parts_and_null_content_render_as_the_server_renders_them(models):
    """OpenAI's content parts of type "text" are the text they join to and null content is "" (the server's reading,
    ``ChatMessage``), not the Python repr of a list or "None" in the prompt; parts that are not text are refused."""
    llm = LLM(model=str(models["hf"]), dtype="float32", max_model_len=128)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "café"}]},
             {"role": "assistant", "content": None}]  # fmt: skip
    plain = [{"role": "user", "content": "hello café"}, {"role": "assistant", "content": ""}]
    out = llm.chat(parts, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt == _expected(models, plain)[0]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    for bad in (image, [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": 5}]):
        with pytest.raises(ValueError, match="content"):
            llm.chat(bad, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.allocator.num_used == 0


def test_chat_refuses_a_bare_message_and_a_template_that_is_not_text(models):
    """A message dict where a list of them is due, or None, is a ValueError (was a KeyError / TypeError); a
    ``chat_template`` that is not a string (a Path, say) is refused, not silently replaced by the default one."""
    llm = LLM(model=str(models["hf"]), dtype="float32", max_model_len=128)
    for bad in ({"role": "user", "content": "x"}, None, "hello"):
        with pytest.raises(ValueError, match="messages must be a non-empty list"):
            llm.chat(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat(MESSAGES, use_tqdm=False, chat_template=Path("template.jinja"))


def test_a_chat_without_tools_gives_the_template_tools_none(llm):
    """transformers (and the server) hand every template ``tools`` and ``documents``, None where there are none:
    Mistral's ``{% if tools is not none %}`` must not write an empty tool list into every prompt."""
    template = ("{% if tools is not none %}[tools]{% endif %}{% if documents is not none %}[docs]{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")  # fmt: skip
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template=template)  # fmt: skip
    assert out[0].prompt == "hi"


def test_named_templates_take_tool_use_with_tools(tmp_path):
    """A tokenizer_config.json with named templates (Hermes, Command-R): "tool_use" where tools are given, "default"
    elsewhere (transformers' choice); a ``chat_template`` naming one of them is that one."""
    from spec_engine.chat_template import ChatTemplate

    named = [{"name": "default", "template": "D{{ messages[0].content }}"},
             {"name": "tool_use", "template": "T{{ tools | length }}{{ messages[0].content }}"},
             {"name": "rag", "template": "R{{ messages[0].content }}"}]  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    hi = [{"role": "user", "content": "hi"}]
    assert ChatTemplate(tmp_path).render(hi) == "Dhi"
    assert ChatTemplate(tmp_path).render(hi, tools=[{"type": "function"}]) == "T1hi"
    assert ChatTemplate(tmp_path, source="rag").render(hi, tools=[{"type": "function"}]) == "Rhi"


def test_malformed_tool_calls_are_a_value_error(llm):
    """An assistant's ``tool_calls`` that are not a list of call dicts get a ValueError naming them (was an
    AttributeError from inside the renderer)."""
    for calls in ([5], {"id": "c"}, [{"id": "c", "function": "f"}]):
        messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        with pytest.raises(ValueError, match="tool_calls"):
            llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)


def _hf_dir(root: Path, config: dict, files: dict[str, str]) -> Path:
    """A tokenizer directory as the Hub ships one: tokenizer.json, tokenizer_config.json and ``files``."""
    root.mkdir()
    chatml_tokenizer(SPECIALS).save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    for name, text in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text(text)
    return root


def test_an_hf_directory_renders_what_transformers_renders(tmp_path):
    """transformers' choices in an HF directory: chat_template.jinja and additional_chat_templates/*.jinja win over
    tokenizer_config.json's entries (a template fixed on the Hub in the file, the config's copy stale), and a legacy
    special_tokens_map.json (a config without added_tokens_decoder) gives the special tokens the template writes."""
    from spec_engine.chat_template import ChatTemplate

    transformers = pytest.importorskip("transformers")
    stale = {"chat_template": "OLD{{ bos_token }}{{ messages[0].content }}"}
    eos = {"content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    cases = {
        "file": _hf_dir(tmp_path / "file", stale, {"chat_template.jinja": "NEW{{ messages[0].content }}"}),
        "named files": _hf_dir(tmp_path / "named", stale, {"chat_template.jinja": "D{{ messages[0].content }}",
                               "additional_chat_templates/tool_use.jinja": "T{{ tools | length }}"}),  # fmt: skip
        "special map": _hf_dir(tmp_path / "special", {"chat_template": "{{ bos_token }}{{ eos_token }}"},
                               {"special_tokens_map.json": json.dumps({"bos_token": SPECIALS[1], "eos_token": eos})}),
    }  # fmt: skip
    hi, tools = [{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f"}}]
    for name, root in cases.items():
        hf = transformers.AutoTokenizer.from_pretrained(str(root))
        for kw in ({}, {"tools": tools}):
            assert ChatTemplate(root).render(hi, **kw) == hf.apply_chat_template(hi, tokenize=False, **kw), (name, kw)


def test_smollm2_renders_as_transformers(smollm2):
    """SmolLM2's own template from its GGUF file, ours vs transformers' apply_chat_template: the default system turn
    where none is given, a system message, several turns, with and without the generation prompt. (transformers'
    GGUF loader takes 15 s to convert the tokenizer: the template goes to an empty one, with the file's specials.)"""
    import tokenizers

    from spec_engine.chat_template import ChatTemplate

    transformers = pytest.importorskip("transformers")
    ours = ChatTemplate(smollm2)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.BPE()),
                                              chat_template=ours.source, **ours.special)  # fmt: skip
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "café 🎉\n\n  {{ x }} <|im_end|>  "}]  # fmt: skip
    for messages in (turns[:1], turns, [{"role": "system", "content": "be brief"}, *turns]):
        for add in (False, True):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours.render(messages, add_generation_prompt=add) == expected
