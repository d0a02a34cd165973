"""Log-probabilities as OpenAI's APIs show them: a token's text and bytes (``logprob_token_text``), the completions
API's ``logprobs`` object and the chat API's ``logprobs.content`` from a request's ``Request.output_logprobs`` /
``prompt_logprobs`` entries ({token: log-probability, then the alternatives'}); and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import re
from collections.abc import Callable

from tokenizers.decoders import ByteLevel as ByteLevelDecoder

LOGPROB_FLOOR = -9999.0  # OpenAI's log-probability of a token with none (JSON has no -inf)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces
_BYTE_OF = {}  # GPT-2's byte-level BPE alphabet, character -> the byte it stands for (bytes_to_unicode inverted)
for _b in [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]:
    _BYTE_OF[chr(_b)] = _b
for _n, _b in enumerate(b for b in range(256) if chr(b) not in _BYTE_OF):
    _BYTE_OF[chr(256 + _n)] = _b


def logprob_token_text(tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's text and its bytes, as logprobs show them: its vocabulary piece's bytes where the tokenizer's
    convention says them (``_piece_bytes``) as text, ``bytes:\\xNN...`` where they hold part of a character (its text
    alone would be U+FFFD); else its decoded text, a special token's name, or ``token_id:N`` with no tokenizer."""
    if tokenizer is None:
        name = f"token_id:{token_id}"
        return name, name.encode()
    piece = tokenizer.id_to_token(token_id) or ""
    raw = _piece_bytes(tokenizer, piece)
    if raw is None:
        text = tokenizer.decode([token_id]) or piece  # (a special token decodes to nothing: its name)
        return text, text.encode()
    try:
        return raw.decode(), raw
    except UnicodeDecodeError:  # part of a character: named by its bytes, as OpenAI names such tokens
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def _piece_bytes(tokenizer, piece: str) -> bytes | None:
    """A vocabulary piece's bytes where its convention says them: GPT-2's byte-level alphabet (a byte-level
    decoder), or SentencePiece's (``<0xNN>`` a byte, ``\u2581`` a space: decoding a token alone would drop a word's
    leading space); None otherwise."""
    if isinstance(tokenizer.decoder, ByteLevelDecoder) and piece and all(c in _BYTE_OF for c in piece):
        return bytes(_BYTE_OF[c] for c in piece)
    if (byte := _BYTE_FALLBACK.fullmatch(piece)) is not None:
        return bytes([int(byte.group(1), 16)])
    if "\u2581" in piece:
        return piece.replace("\u2581", " ").encode()
    return None


def _logprob(value: float) -> float:
    """A log-probability as JSON can carry it: -inf (and NaN) as OpenAI's floor, -9999."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(ids: list[int], entries: list[dict[int, float] | None], token_text: Callable,
                         offset: int) -> tuple[dict, int]:  # fmt: skip
    """The completions API's ``logprobs`` of tokens ``ids`` (their ``Request.output_logprobs`` or
    ``prompt_logprobs`` entries; None for a prompt's first token) whose text starts at character ``offset``, and the
    offset after them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(ids, entries):
        text, raw = token_text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(raw.decode(errors="replace"))
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_logprob(entry[token]))
        top = {text: _logprob(entry[token])}  # (the token's own value wins a key two tokens' texts share)
        for t, v in entry.items():
            top.setdefault(token_text(t)[0], _logprob(v))
        out["top_logprobs"].append(top)
    return out, offset


def chat_content_logprobs(ids: list[int], entries: list[dict[int, float]], token_text: Callable, k: int) -> list[dict]:
    """The chat API's ``logprobs.content`` of tokens ``ids``: each token's, with its ``k`` most likely alternatives
    in rank order (the token itself among them where it is one)."""

    def item(token: int, value: float) -> dict:
        text, raw = token_text(token)
        return {"token": text, "logprob": _logprob(value), "bytes": list(raw)}

    content = []
    for token, entry in zip(ids, entries):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        content.append({**item(token, entry[token]), "top_logprobs": [item(t, v) for t, v in top]})
    return content


def vllm_prompt_logprobs(ids: list[int], entries: list[dict[int, float] | None], token_text: Callable,
                         k: int) -> list[dict | None]:  # fmt: skip
    """vLLM's ``prompt_logprobs`` of prompt tokens ``ids`` (their entries, ``k`` alternatives each asked for): None
    for the first token, else {token id as a string: {"logprob", "rank", "decoded_token"}} for the token and its
    alternatives; rank 1 is the most likely, and the token's own rank is null where it is not among the k (its
    exact rank is not computed)."""
    out: list[dict | None] = []
    for token, entry in zip(ids, entries):
        if entry is None:
            out.append(None)
            continue
        top = [t for t in entry if t != token or len(entry) == k]  # the k alternatives (the token among them or not)
        ranked = sorted(top, key=lambda t: -entry[t])
        out.append({str(t): {"logprob": _logprob(v), "rank": ranked.index(t) + 1 if t in ranked else None,
                             "decoded_token": token_text(t)[0]} for t, v in entry.items()})  # fmt: skip
    return out
