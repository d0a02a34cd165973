"""The OpenAI request bodies the server accepts, validated field by field with pydantic (strict: no "0.5" strings
for numbers, no booleans for ints). The chat template lives in ``spec_engine.chat_template``.

Extensions beyond OpenAI's fields (as in vLLM): ``top_k`` (0 or -1 = off), ``min_p``, ``stop_token_ids``,
``ignore_eos``, ``repetition_penalty``, ``min_tokens``, ``allowed_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``truncate_prompt_tokens``, ``bad_words``, ``prompt_logprobs``, ``guided_choice``,
``guided_json``, ``guided_regex``, ``guided_grammar`` (also as ``structured_outputs: {"choice" | "json" | "regex" |
"grammar" | "json_object": ...}``), and OpenAI's ``response_format`` (``json_object``, ``json_schema``) and ``tools``
with ``tool_choice`` "none", "required" or a named function (``spec_engine.server.tools``). Fields that would change
the output but are not implemented (the chat API's ``echo``, ``functions``, ...) are rejected with 400 when
set, never silently ignored; unknown fields are ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from spec_engine.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate  # noqa: F401  (the server's names)
from spec_engine.sampling import GRAMMAR_GUIDES, MAX_LOGPROBS
from spec_engine.server.tools import tool_schema

MAX_TOOLS = 128  # tools a chat request may define (OpenAI's bound)

_UNSUPPORTED = {  # field -> the values that mean "not used" (absent and null always do)
    "top_logprobs": (0,),  # (the completions API's; chat declares its own)
    "echo": (False,),  # (the chat API's; completions declares its own)
    "suffix": ("",),
    "best_of": (1,),
    "functions": ([],),
    "function_call": ("none",),
    "guided_whitespace_pattern": (),  # (vLLM's)
    "chat_template": (),  # (vLLM's, a template per request; the server's own is --chat-template)
    "continue_final_message": (False,),  # (vLLM's)
    "use_beam_search": (False,),  # (vLLM's)
    "length_penalty": (1.0,),  # (vLLM's, beam search's)
    "logits_processors": ([],),  # (vLLM's)
    "return_tokens_as_token_ids": (False,),  # (vLLM's)
    "spaces_between_special_tokens": (True,),  # (vLLM's; this server's decoder never adds them)
}
TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt")  # what chat_template_kwargs may not set


# structured_outputs' keys: the guides this server reads, and vLLM's options for its grammar backends (ignored)
_STRUCTURED_GUIDES = {"choice": "guided_choice", "json": "guided_json", "regex": "guided_regex",
                      "grammar": "guided_grammar", "json_object": "guided_json"}  # fmt: skip
_STRUCTURED_OPTIONS = ("backend", "disable_fallback", "disable_any_whitespace")  # (the first two change nothing here)
ANY_JSON_OBJECT = {"type": "object"}  # response_format json_object's schema


def _parsed_schema(schema):
    """A schema given as JSON text, parsed (what two spellings of one schema compare by)."""
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except (ValueError, RecursionError):
            return schema  # (SamplingParams says what is wrong with it)
    return schema


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text (no guide), any JSON object, or JSON following a schema."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_asked(self) -> dict | None:
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            return self.json_schema.schema_
        return ANY_JSON_OBJECT if self.type == "json_object" else None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # (vLLM's: each chunk carries its choice's usage so far)


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "the default"."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None  # (SamplingParams takes one string as a list, and checks count and lengths)
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None  # (SamplingParams checks the ranges)
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # (vLLM's extension)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings -> biases
    min_tokens: int | None = Field(None, ge=0)  # (vLLM's extension)
    allowed_token_ids: list[int] | None = None  # (vLLM's extension)
    include_stop_str_in_output: bool | None = None  # (vLLM's extension)
    skip_special_tokens: bool = True  # (vLLM's extension)
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # (vLLM's extension: the prompt's last k tokens)
    bad_words: list[str] | None = None  # (vLLM's extension; SamplingParams checks count and lengths)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # (vLLM's extension: each prompt token's)
    add_special_tokens: bool | None = None  # (vLLM's: the tokenizer's BOS...; None: the completions API adds them,
    # the chat API where the chat template does not write them itself)
    guided_choice: list[str] | None = None  # (vLLM's extension: the output is one of these)
    guided_json: dict[str, Any] | str | None = None  # (vLLM's: a JSON schema the output follows)
    guided_regex: str | None = None  # (vLLM's)
    guided_grammar: str | None = None  # (vLLM's; a Lark grammar, llguidance's dialect)
    structured_outputs: dict[str, Any] | None = None  # (vLLM's newer form of the four: choice, json, regex, grammar)
    response_format: ResponseFormat | None = None  # (OpenAI's: text, json_object, json_schema)
    ignore_eos: bool = False
    n: int | None = Field(None, ge=1)  # choices (SamplingParams checks the most)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, v):  # (one message for either shape, not the union's two)
        if v is None or isinstance(v, str) or isinstance(v, list) and all(isinstance(t, str) for t in v):
            return v
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("structured_outputs")
    @classmethod
    def _known_guides(cls, v):
        set_ = {k: x for k, x in (v or {}).items() if x is not None and x is not False}
        others = sorted(k for k in set_ if k not in _STRUCTURED_GUIDES and k not in _STRUCTURED_OPTIONS)
        if others:
            raise ValueError(f"only {sorted(_STRUCTURED_GUIDES)} are supported, not {others}")
        guides = [k for k in set_ if k in _STRUCTURED_GUIDES]
        if len(guides) > 1:  # (none: its options for a guide named elsewhere, or nothing)
            raise ValueError(f"give one of {sorted(_STRUCTURED_GUIDES)}, not {guides}")
        kinds = {"choice": list, "json": (dict, str), "regex": str, "grammar": str, "json_object": bool}
        for k in guides:
            if not isinstance(set_[k], kinds[k]) or isinstance(set_[k], bool) != (k == "json_object"):
                raise ValueError(f"'{k}' has the wrong type")
        if not isinstance(set_.get("disable_any_whitespace", False), bool):
            raise ValueError("'disable_any_whitespace' must be true or false")
        choice = set_.get("choice")
        if choice is not None and not (choice and all(isinstance(c, str) for c in choice)):
            raise ValueError("'choice' must be a non-empty list of strings")
        return v

    def guides_asked(self) -> dict[str, Any]:
        """The ``SamplingParams`` guide the request asks for ({} or one of ``guided_choice``, ``guided_json``,
        ``guided_regex``, ``guided_grammar``), from the field of that name, ``structured_outputs`` or
        ``response_format``; ValueError where they ask for different ones."""
        asked = [(name, getattr(self, name)) for name in ("guided_choice", *GRAMMAR_GUIDES)
                 if getattr(self, name) is not None]  # fmt: skip
        for key, value in (self.structured_outputs or {}).items():
            if key in _STRUCTURED_GUIDES and value is not None and value is not False:
                asked.append((_STRUCTURED_GUIDES[key], ANY_JSON_OBJECT if key == "json_object" else value))
        schema = self.response_format.schema_asked() if self.response_format is not None else None
        if schema is not None:
            asked.append(("guided_json", schema))
        parsed = [(n, _parsed_schema(v) if n == "guided_json" else v) for n, v in asked]  # (a schema as text too)
        distinct = dict(asked)
        if any(p != parsed[0] for p in parsed[1:]):
            raise ValueError(f"the request asks for {len(asked)} different outputs ({', '.join(n for n, _ in asked)}, "
                             "from guided_*, structured_outputs and response_format): give one")  # fmt: skip
        if (self.structured_outputs or {}).get("disable_any_whitespace"):
            distinct["disable_any_whitespace"] = True
        return distinct

    def guide_field(self, name: str | None) -> str | None:
        """The request's field that asked for the guide ``name`` (a ``SamplingParams`` field: an error about it is
        the client's ``response_format`` or ``structured_outputs`` where that is what it sent); any other name as
        it is."""
        if name not in _STRUCTURED_GUIDES.values() or getattr(self, name, None) is not None:
            return name
        if name == "guided_json" and self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return "structured_outputs" if self.structured_outputs else name

    def unsupported_field(self) -> str | None:
        """The first field set to a value this server does not implement (OpenAI's, or vLLM's extensions)."""
        for name, unused in _UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            # (a bool is not its number: top_logprobs 0 is not false)
            no_op = any(value == u and isinstance(value, bool) == isinstance(u, bool) for u in unused)
            if value is not None and not no_op:
                return name
        return None


class CompletionRequest(SamplingRequest):
    prompt: Any = Field(..., description="a string or a list of token ids (one prompt per request)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the alternatives beside each token's (0: its own)
    echo: bool | None = None  # the prompt before the completion (with logprobs: the prompt tokens' logprobs first)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, v):
        return None if v is False else v  # (what chat's boolean means; true stays an error: which number?)

    def logprobs_asked(self) -> int | None:
        """``SamplingParams.logprobs``: the alternatives asked for beside each token (None: no logprobs)."""
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """``SamplingParams.prompt_logprobs``: the prompt's, asked for (vLLM's ``prompt_logprobs``) or echoed with
        logprobs (one list of alternatives serves both: the two counts must agree)."""
        echoed = self.logprobs if self.echo else None
        if self.prompt_logprobs is not None and echoed is not None and self.prompt_logprobs != echoed:
            raise ValueError(f"prompt_logprobs ({self.prompt_logprobs}) and logprobs with echo ({echoed}) ask for "
                             "different numbers of the prompt's alternatives")  # fmt: skip
        return self.prompt_logprobs if self.prompt_logprobs is not None else echoed

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # ["text"] or [[ids]]: a batch of one
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            raise ValueError("batched prompts are not supported: send one request per prompt")
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str | dict[str, Any] = ""  # (JSON text, as OpenAI sends it; an object too, as vLLM takes)


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = ""  # (absent or null: "", so a template may always read it)
    tool_calls: list[ToolCall] | None = None  # (an assistant's earlier calls)
    tool_call_id: str | None = None  # (a tool message's: the call it answers)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, v):
        """A string, or OpenAI content parts of type "text" (joined); null becomes ""."""
        if v is None or isinstance(v, str):
            return v or ""
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in v):
            if all(isinstance(p.get("text"), str) for p in v):
                return "".join(p["text"] for p in v)
        raise ValueError("content must be a string or a list of {'type': 'text', 'text': str} parts")


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # (a JSON schema of its arguments; none: any object)
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v):
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("parameters must be a JSON schema of an object (the call's named arguments)")
        return v


class ToolDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class ToolName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: ToolName


def _template_kwargs(cls, v):
    """``chat_template_kwargs``: more variables for the chat template, none of those the server sets itself."""
    taken = sorted(set(v or ()) & set(TEMPLATE_VARIABLES))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken} (the request's own fields set them)")
    return v


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True  # (vLLM's: the template opens the assistant's turn)
    chat_template_kwargs: dict[str, Any] | None = None  # (vLLM's: more variables for the chat template)
    _kwargs = field_validator("chat_template_kwargs")(classmethod(_template_kwargs))
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # (needs logprobs: true, as OpenAI's)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v):
        names = [t.function.name for t in v or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tool names must be unique: {twice} given twice")
        return v

    def template_inputs(self) -> tuple[list[dict], list[dict] | None]:
        return template_inputs(self.messages, self.tools)

    def tool_choice_asked(self) -> str | dict:
        """``tool_choice`` as ``spec_engine.server.tools`` takes it: "none", "required" or {"type": "function",
        "function": {"name": ...}}; ValueError for "auto" (OpenAI's default with tools), which needs a parser of the
        model's own tool-call format, and for a choice without tools."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "auto":
            raise ValueError("tool_choice 'auto' is not supported (it needs a parser of this model's own tool-call "
                             "format): give tool_choice 'required' or name a function")  # fmt: skip
        if choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        return choice if isinstance(choice, str) else choice.model_dump()

    def guide_field(self, name: str | None) -> str | None:
        if name == "guided_json" and self.tools and self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"  # (the one guide beside it: guides_asked)
        return super().guide_field(name)

    def guides_asked(self) -> dict[str, Any]:
        guides = super().guides_asked()
        tools = [t.model_dump() for t in self.tools or ()]
        schema = tool_schema(tools, self.tool_choice_asked(), self.parallel_tool_calls is not False)
        if schema is None:
            return guides
        if any(k != "disable_any_whitespace" for k in guides):
            raise ValueError("tool_choice with guided_*, structured_outputs or response_format: give one")
        return {**guides, "guided_json": schema}

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def logprobs_asked(self) -> int | None:
        """``SamplingParams.logprobs``: the alternatives asked for beside each token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_asked(self) -> int | None:
        return self.prompt_logprobs


def template_inputs(messages: list[ChatMessage], tools: list[ToolDef] | None) -> tuple[list[dict], list[dict] | None]:
    """The chat template's ``messages`` (``ChatTemplate.render`` parses earlier calls' arguments) and ``tools``."""
    dumped = [t.model_dump(exclude_none=True) for t in tools or ()]
    return [m.model_dump(exclude_none=True) for m in messages], dumped or None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: the token ids the completions API makes of ``prompt``, or the chat API of ``messages``
    (and ``tools``) through the model's chat template."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True  # (messages only)
    chat_template_kwargs: dict[str, Any] | None = None  # (messages only)
    add_special_tokens: bool | None = None  # (None: as the completions or the chat API encodes)
    return_token_strs: bool = False  # each token's own string beside its id (the vocabulary's spelling)
    _kwargs = field_validator("chat_template_kwargs")(classmethod(_template_kwargs))

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give one of prompt and messages")
        if (self.tools is not None or self.chat_template_kwargs is not None) and self.messages is None:
            raise ValueError("tools and chat_template_kwargs go with messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: the text of ``tokens``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def error_param(loc: tuple) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None
