"""One input processor (vLLM's ``InputProcessor``): what ``LLM.generate``, ``AsyncEngine`` and the server do to a
request before the engine takes it.

Glossary:
    prompt      a str, vLLM's ``{"prompt": str}`` or ``{"prompt_token_ids": [int, ...]}``; to the engine, token ids
    word ids    the token ids of ``bad_words`` and ``guided_choice`` strings (encoded with no special tokens)
    sequence    one of a request's ``n`` samples: one engine request each, its seed derived from the request's
                (``sampling.sequence_params``)

Every request then passes the engine's checks (``RequestLimits``: sizes, ids, guides, the context, the KV cache),
which need no tokenizer; what needs the tokenizer or the request's ``n`` is done by ``InputProcessor``, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from spec_engine.sampling import GRAMMAR_GUIDES, SamplingParams, sequence_params, truncate_prompt, with_token_ids
from spec_engine.structured import Grammars

# Texts at least this long are tokenised in a worker thread with ``encode_batch``, which releases the GIL (``encode``
# holds it: a megabyte prompt froze the event loop for as long as it took to encode; off the loop, it does not).
LONG_TEXT = 8192


async def tokenize(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of ``text`` (an HF ``tokenizers.Tokenizer``), off the event loop when the text is long.

    Raises ``ValueError`` for text that is not valid Unicode (a lone surrogate, which ``json.loads`` lets through)."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise ValueError("the text is not valid Unicode: it holds a lone surrogate") from None
    if len(text) < LONG_TEXT:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    (encoding,) = await asyncio.to_thread(tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens)
    return encoding.ids


class InputProcessor:
    """Prompts to token ids, ``SamplingParams`` to the engine's: word ids filled in, ``n`` expanded to sequences.

    Parameters
    ----------
    tokenizer : the model's HF ``tokenizers.Tokenizer``, or None (a model without tokenizer.json: token ids only).
    model_dir : the model's path, named in the errors.
    """

    def __init__(self, tokenizer, model_dir: str | Path):
        self.tokenizer = tokenizer
        self.model_dir = model_dir

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer: pass {{'prompt_token_ids': [...]}} instead")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_words(self, text: str) -> list[int]:
        """Text's tokens with no special tokens around them: ``bad_words`` and ``guided_choice`` strings as token
        ids."""
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer: give bad_words_token_ids / guided_choice_token_ids "
                             "instead of strings")  # fmt: skip
        return self.encode(text, add_special_tokens=False)

    def prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt of ``LLM.generate``: a str, ``{"prompt": str}`` (vLLM's TextPrompt)
        or ``{"prompt_token_ids": [...]}``."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), (list, tuple)):
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.encode(prompt["prompt"])
        raise ValueError("each prompt must be a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}")

    async def prompt_async(self, prompt: str | list[int]) -> list[int]:
        """The token ids of a served prompt (text or ids); long text is encoded off the event loop."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json: pass the prompt as token ids")
        return await tokenize(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)

    def require_tokenizer(self, params: SamplingParams) -> None:
        """Refuse text fields a model without a tokenizer cannot follow (the server's check: one ``ValueError``
        whose message starts with the field's name)."""
        for name in ("bad_words", "guided_choice", *GRAMMAR_GUIDES):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"{name} needs a tokenizer; this model has none")

    def word_ids(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``bad_words`` and ``guided_choice`` token ids filled in (``sampling.with_token_ids``);
        ``params`` itself when there is nothing to fill in, so a second call is free."""
        return with_token_ids(params, self.encode_words)

    @staticmethod
    def sequences(params: SamplingParams) -> list[SamplingParams]:
        """The ``params.n`` sequences of a request, one engine request each: the first with the request's seed (its
        tokens are those of the same request with n = 1), the others with seeds derived from it."""
        return [sequence_params(params, i) for i in range(params.n)]


class RequestError(ValueError):
    """A request that can never run (``RequestLimits.check``); ``param`` names the field at fault, or None."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestLimits:
    """What an engine can run: the checks every request passes before it is queued (``Engine.check_request``).

    Parameters
    ----------
    vocab_size, max_model_len : the target's vocabulary and the longest prompt + output.
    eos_token_ids : the model's EOS ids (a request stops at them unless it ignores EOS).
    reads_text : the engine can read its output as text (stop strings need it).
    grammars : the model's compiled guides (``structured.Grammars``), or None without a tokenizer.
    fits : whether a request of that many tokens (prompt + max_tokens) fits the KV cache alone.
    """

    def __init__(self, vocab_size: int, max_model_len: int, eos_token_ids: set[int], *, reads_text: bool,
                 grammars: Grammars | None, fits: Callable[[int], bool]):  # fmt: skip
        self.vocab_size, self.max_model_len, self.eos_token_ids = vocab_size, max_model_len, eos_token_ids
        self.reads_text, self.grammars, self.fits = reads_text, grammars, fits

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a request (``Request.stop_ids``): its stop_token_ids, and the EOS ids unless it
        ignores EOS."""
        stops = set(params.stop_token_ids or [])
        return frozenset(stops if params.ignore_eos else stops | self.eos_token_ids)

    def check(self, ids: list[int], params: SamplingParams) -> list[int]:
        """Raise ``RequestError`` for a request that can never run. Returns the prompt it checked: as
        ``truncate_prompt_tokens`` cuts it."""
        params.validate()
        ids = truncate_prompt(ids, params.truncate_prompt_tokens)
        if params.n != 1:
            raise RequestError(f"the engine runs one sequence a request, not {params.n} (LLM.generate expands n)", "n")
        if params.stop and not self.reads_text:
            raise RequestError("stop strings need a tokenizer to read the output; this model has none", "stop")
        if not ids:
            raise RequestError("the prompt is empty: give at least one token", "prompt")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be ints in [0, {self.vocab_size})", "prompt")
        bad_ids = [t for seq in params.bad_words_token_ids or () for t in seq]
        choice_ids = [t for seq in params.guided_choice_token_ids or () for t in seq]
        for name, named in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                            ("bad_words", bad_ids), ("guided_choice", choice_ids)):  # fmt: skip
            if named and max(named) >= self.vocab_size:  # (SamplingParams checked them to be ints >= 0)
                raise RequestError(f"{name} must name token ids in [0, {self.vocab_size})", name)
        for name in ("bad_words", "guided_choice"):
            if getattr(params, name) and getattr(params, f"{name}_token_ids") is None:
                raise RequestError(f"{name} need their token ids (LLM.generate and the server fill them in with the "
                                   f"tokenizer; the engine has none): pass {name}_token_ids", name)  # fmt: skip
        guide = "guided_choice" if choice_ids else params.guided and params.guided[0]
        if params.guided and self.grammars is None:
            raise RequestError(f"{guide} needs the model's tokenizer; this model has none", guide)
        if guide and not any(0 <= t < self.vocab_size for t in self.stop_ids(params)):
            raise RequestError(f"{guide} ends at a stop token, and this request has none (the model names no EOS): "
                               "pass stop_token_ids", guide)  # fmt: skip
        if params.guided:
            try:
                self.grammars.check(params)
            except ValueError as e:
                raise RequestError(str(e), guide) from None
        if params.min_tokens and params.allowed_token_ids and set(params.allowed_token_ids) <= self.stop_ids(params):
            raise RequestError("allowed_token_ids are all stop tokens, which min_tokens holds back: nothing could be "
                               "emitted", "allowed_token_ids")  # fmt: skip
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.max_model_len})",
                "max_tokens",
            )
        if not self.fits(len(ids) + params.max_tokens):
            raise RequestError(
                "this request needs more KV blocks than the whole cache holds; raise the KV budget", "max_tokens"
            )
        return ids
