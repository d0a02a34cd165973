"""A model's chat template: the Jinja source that turns a conversation (``[{"role": ..., "content": ...}]``) into
the prompt text, rendered as transformers renders it. One renderer serves ``LLM.chat``, ``specdec generate --chat``
and the server's ``/v1/chat/completions``."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

# The default chat format, for models whose tokenizer_config.json has no chat_template: one "<|role|>\n" header per
# message, the content, a newline, then the assistant header the model continues from.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplate:
    """The model's chat template rendered as transformers does, or ``DEFAULT_CHAT_TEMPLATE`` when the model has none.

    The template comes from an HF directory (``tokenizer_config.json``'s ``chat_template``, or a
    ``chat_template.jinja`` file) or a GGUF file (``tokenizer.chat_template``); ``source`` overrides it, with its
    Jinja source or the name of one of the model's named templates. Of named templates (a list in
    tokenizer_config.json), "tool_use" renders conversations given tools and "default" the others (transformers').
    ``from_model`` says whether the rendered text already carries the special tokens (BOS...), in which case it
    must be encoded without adding them again.
    """

    def __init__(self, model: str | Path | None, source: str | None = None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if source is not None and not isinstance(source, str):  # (a Path would otherwise fall back to the default)
            raise ValueError(f"chat_template must be the template's Jinja source (a str), got {type(source).__name__}")
        named, self.special = _model_templates(Path(model)) if model is not None else ({}, {})
        if source is not None:
            named = {"default": named.get(source, source)}
        self.from_model = bool(named)
        self.source = named.get("default") or next(iter(named.values()), DEFAULT_CHAT_TEMPLATE)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_tag()]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
            self._tool_use = env.from_string(named["tool_use"]) if "tool_use" in named else self._template
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e

    def render(self, messages: list, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for ``messages`` (dicts with "role" and "content", or pydantic models of them);
        ``kwargs`` reach the template as variables. Content is text, as the server reads it (``_text_content``). A
        template error (e.g. roles that must alternate), or one on values the template did not expect (a variable
        of another type), raises ``ValueError``."""
        import jinja2

        messages = _parsed_tool_calls(
            [_text_content(m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)) for m in messages]
        )
        template = self._tool_use if kwargs.get("tools") is not None else self._template
        try:  # (tools and documents None where not given, as transformers passes them: "tools is not none" tests)
            return template.render(
                **{"tools": None, "documents": None, **self.special, **kwargs},
                messages=messages,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e
        except (TypeError, ValueError, LookupError, ArithmeticError) as e:  # (the template on values it did not expect)
            raise ValueError(f"chat template: {e!r}") from e


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """Jinja's ``tojson`` as transformers' templates call it (no HTML escaping; its keyword arguments)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_tag():
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's part for training masks):
    its body, as written."""
    import jinja2.ext
    from jinja2 import nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        @staticmethod
        def _body(caller):
            return caller()

    return Generation


def _text_content(message: dict) -> dict:
    """``message`` with its content as the text a template writes, as the server's ``ChatMessage`` reads it: OpenAI
    content parts of type "text" joined, null or absent content "" (a template would write "None", or a list's
    repr). ValueError for other parts (images...: this engine takes text) or content of another type."""
    content = message.get("content")
    if isinstance(content, str):
        return message
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return {**message, "content": "".join(p["text"] for p in content)}
    raise ValueError(f"message content must be a string or a list of {{'type': 'text', 'text': str}} parts, got "
                     f"{content!r}"[:300])  # fmt: skip


def _parsed_tool_calls(messages: list[dict]) -> list[dict]:
    """``messages`` with an assistant's earlier ``tool_calls`` carrying their ``arguments`` as the dict chat
    templates write out with ``tojson`` (OpenAI sends JSON text: parsed, "" as {}, kept as text where it is not
    JSON), as transformers' callers (vLLM) hand them over."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            if not isinstance(m["tool_calls"], list) or not all(
                isinstance(c, dict) and isinstance(c.get("function") or {}, dict) for c in m["tool_calls"]
            ):
                raise ValueError(f"tool_calls must be a list of {{'id', 'type', 'function': {{'name', 'arguments'}}}} "
                                 f"dicts, got {m['tool_calls']!r}"[:300])  # fmt: skip
            for call in m["tool_calls"]:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                    except (ValueError, RecursionError):  # (RecursionError: nesting past Python's stack)
                        pass
                calls.append({**call, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _model_templates(model: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({name: template source}, special token texts) of an HF directory or a GGUF file: its named templates, or its
    one template as "default"; {} where it has none."""
    from spec_engine.models.gguf import gguf_path_or_none
    from spec_engine.models.gguf_tokenizer import gguf_chat_template, gguf_special_tokens

    if gguf_path_or_none(model) is not None:
        source = gguf_chat_template(model)
        return ({"default": source} if isinstance(source, str) else {}), gguf_special_tokens(model)
    cfg = _json_file(model / "tokenizer_config.json")
    source = cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        named = {k: v for k, v in named.items() if isinstance(k, str) and isinstance(v, str)}
    else:
        named = {"default": source} if isinstance(source, str) else {}
    # template files win over the config's entries, as in transformers (a template fixed on the Hub in its file can
    # leave a stale copy in the config)
    files = {"default": model / "chat_template.jinja"} if (model / "chat_template.jinja").is_file() else {}
    files |= {f.name.removesuffix(".jinja"): f for f in sorted(model.glob("additional_chat_templates/*.jinja"))}
    if files:
        named = {name: f.read_text(encoding="utf-8") for name, f in files.items()}
    if "added_tokens_decoder" not in cfg:  # (a legacy directory: transformers takes its special_tokens_map.json)
        cfg |= _json_file(model / "special_tokens_map.json")
    special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return named, special


def _json_file(path: Path) -> dict:
    """A JSON object file's contents; {} where there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"corrupt {path}: not a JSON object")
    return data


def _token_text(tok) -> str:
    if isinstance(tok, dict):  # AddedToken serialised as {"content": "<s>", ...}
        return tok.get("content", "")
    return tok or ""
