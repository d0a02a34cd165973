"""The OpenAI request bodies the server accepts, validated field by field with pydantic (strict: no "0.5" strings
for numbers, no booleans for ints). The chat template lives in ``spec_engine.chat_template``.

Extensions beyond OpenAI's fields (as in vLLM): ``top_k`` (0 or -1 = off), ``min_p``, ``stop_token_ids``,
``ignore_eos``, ``repetition_penalty``, ``min_tokens``, ``allowed_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``truncate_prompt_tokens``, ``bad_words``, ``prompt_logprobs``, ``guided_choice`` (also as
``structured_outputs: {"choice": [...]}``). Fields that would change the output but are not implemented (the chat
API's ``echo``, ``tools``, ...) are rejected with 400 when set, never silently ignored; unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from spec_engine.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate  # noqa: F401  (the server's names)
from spec_engine.sampling import MAX_LOGPROBS

_UNSUPPORTED = {  # field -> the values that mean "not used" (absent and null always do)
    "top_logprobs": (0,),  # (the completions API's; chat declares its own)
    "echo": (False,),  # (the chat API's; completions declares its own)
    "suffix": ("",),
    "best_of": (1,),
    "tools": ([],),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    # vLLM's extensions this server does not implement (top_k, min_p, stop_token_ids, ignore_eos,
    # repetition_penalty, min_tokens, allowed_token_ids, include_stop_str_in_output, skip_special_tokens,
    # truncate_prompt_tokens, bad_words, prompt_logprobs, guided_choice and structured_outputs' choice it does)
    "guided_json": (),
    "guided_regex": (),
    "guided_grammar": (),
}


# structured_outputs' keys this server reads ("choice") or may ignore (vLLM's options for its grammar backends)
_STRUCTURED_OPTIONS = ("choice", "backend", "disable_fallback", "disable_any_whitespace",
                       "disable_additional_properties", "whitespace_pattern")  # fmt: skip


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = None


class _SamplingRequest(BaseModel):
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
    guided_choice: list[str] | None = None  # (vLLM's extension: the output is one of these)
    structured_outputs: dict[str, Any] | None = None  # (vLLM's newer form: {"choice": [...]} only)
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
    def _choice_only(cls, v):
        others = sorted(k for k, x in (v or {}).items() if k not in _STRUCTURED_OPTIONS and x not in (None, False))
        if others:
            raise ValueError(f"only 'choice' is supported, not {others}")
        choice = None if v is None else v.get("choice")
        if v is not None and not (isinstance(choice, list) and choice and all(isinstance(c, str) for c in choice)):
            raise ValueError("'choice' must be a non-empty list of strings")
        return v

    def choices_asked(self) -> list[str] | None:
        """``SamplingParams.guided_choice``: ``guided_choice`` or ``structured_outputs["choice"]``."""
        other = (self.structured_outputs or {}).get("choice")
        if self.guided_choice is not None and other is not None and other != self.guided_choice:
            raise ValueError("guided_choice and structured_outputs.choice differ: give one")
        return self.guided_choice if self.guided_choice is not None else other

    def unsupported_field(self) -> str | None:
        """The first field set to a value this server does not implement (OpenAI's, or vLLM's extensions)."""
        for name, unused in _UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            # (a bool is not its number: top_logprobs 0 is not false)
            no_op = any(value == u and isinstance(value, bool) == isinstance(u, bool) for u in unused)
            if value is not None and not no_op:
                return name
        return None


class CompletionRequest(_SamplingRequest):
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None

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


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # (needs logprobs: true, as OpenAI's)

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


def error_param(loc: tuple) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None
