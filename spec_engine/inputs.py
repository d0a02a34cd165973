"""One input processor (vLLM's ``InputProcessor``): what ``LLM.generate``, ``AsyncEngine`` and the server do to a
request before the engine takes it.

Glossary:
    prompt      a str, vLLM's ``{"prompt": str}`` or ``{"prompt_token_ids": [int, ...]}``; to the engine, token ids
    word ids    the token ids of ``bad_words`` and ``guided_choice`` strings (encoded with no special tokens)
    sequence    one of a request's ``n`` samples: one engine request each, its seed derived from the request's
                (``sampling.sequence_params``)

The engine checks what it can of a request (``Engine.check_request``: sizes, ids, guides, the context); what needs the
tokenizer or the request's ``n`` is done here, once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from spec_engine.sampling import GRAMMAR_GUIDES, SamplingParams, sequence_params, with_token_ids

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
