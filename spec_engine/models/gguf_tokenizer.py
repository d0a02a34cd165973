"""The tokenizer a GGUF file carries, as a ``tokenizers.Tokenizer`` that encodes as llama.cpp does.

Glossary:

- **tokenizer.ggml.model**: which of llama.cpp's tokenizers the vocabulary is for. We build two:
  - ``gpt2``, **byte-level BPE** (Llama 3, Qwen, SmolLM2): tokens spell bytes in GPT-2's byte alphabet; text is cut
    by the regexes ``tokenizer.ggml.pre`` names, then each piece merges by the file's ranked merges.
  - ``llama``, **SentencePiece** (Llama 2, Mistral, Phi-3, Gemma, TinyLlama): tokens spell a space as "▁" (U+2581).
    The text's spaces become "▁", with one "▁" before it where ``add_space_prefix`` says so (the default; Gemma:
    false), then llama.cpp's SPM tokenizer merges: of all adjacent pairs whose joined text is a token, the pair
    making the token of highest **score** (``tokenizer.ggml.scores``) joins first (equal scores: the leftmost),
    until none is left. A character no token covers is spelled as its UTF-8 bytes, the tokens "<0x00>".."<0xFF>"
    (**byte fallback**). llama.cpp reads no merges list for it (an older file's ``tokenizer.ggml.merges`` is
    ignored): ``sentencepiece_merges`` derives one from the scores.
- **token type** (``tokenizer.ggml.token_type``): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
- **added tokens**: the control, unknown and user-defined tokens. llama.cpp matches them whole in the raw text before
  tokenizing what lies between them, as ``tokenizers`` does with added tokens; control and unknown ones are special
  (``skip_special_tokens`` drops them from decoded text). In SentencePiece, the text after an added token gets the
  "▁" prefix again, as the text at the start does.

Where we do not follow llama.cpp: special tokens' text always encodes as the special token (llama.cpp's
``parse_special`` is a caller's choice); a SentencePiece file without BOS / EOS ids gets none (llama.cpp assumes 1
and 2); Phi-3's added tokens strip Unicode whitespace after them, llama.cpp's only C's ``isspace``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from spec_engine.models.gguf import GGUFFile, open_gguf

log = logging.getLogger("spec_engine.models.gguf_tokenizer")

SPACE = "\u2581"  # SentencePiece's "▁", a space in a token's text
# llama.cpp's token types (llama_token_type)
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL = 1, 2, 3
TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE = 4, 5, 6
SUPPORTED_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
_PHI3_UNSTRIPPED = ("<unk>", "<s>", "<|endoftext|>")  # llama.cpp's exceptions to Phi-3's right-stripped tokens

# tokenizer.ggml.pre -> the regexes llama.cpp splits text with before byte-level BPE (llama-vocab.cpp's
# llm_tokenizer_bpe), applied in turn: each cuts every piece the one before left into its matches and the text between
# them, and sees only that piece (unicode.cpp's unicode_regex_split), as a Sequence of "Isolated" Splits does.
# (llama.cpp writes GPT-2's regex without its last "|\s+", but its hand-written matcher for it runs that branch too.)
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b")
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_PRE_REGEXES = {
    # llama.cpp's default, also for a file without the key: runs of punctuation (\p{P}, and the symbols $+<=>^~| but
    # not `) apart, then GPT-2's regex, then runs of digits apart from a space before them and cut into threes
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2_REGEX,),
    "gpt-2": (_GPT2_REGEX,),
    **dict.fromkeys(_DIGIT_SPLIT_PRES, (r"\p{N}", _GPT2_REGEX)),
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
        r"|\s+",
    ),
}
# llama.cpp's LLAMA3 arm: ignore_merges (a pre-token that is a token is that token, whether or not the merges reach it,
# as tiktoken encodes and as Llama 3's tokenizer.json says) and BOS added where the file has no add_bos_token
_LLAMA3_PRES = ("llama-bpe",)
SUPPORTED_PRE_TOKENIZERS = tuple(_PRE_REGEXES)


def _pre_tokenizer(pre: str) -> dict:
    splits = [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        for regex in _PRE_REGEXES[pre]
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level]}


def gguf_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from the file's ``tokenizer.ggml.*`` metadata, or None when it has none.

    Byte-level BPE (``tokenizer.ggml.model == "gpt2"``): the tokens and merges, the pre-tokenizer that
    ``tokenizer.ggml.pre`` names (SmolLM2's ``smollm``: each digit apart, then GPT-2's regex; a file without the key
    gets llama.cpp's ``default`` and a warning, as in llama.cpp), control tokens (type 3) as special added tokens
    and user-defined ones (type 4) as plain added tokens, and BOS / EOS added to every encoding where
    ``add_bos_token`` / ``add_eos_token`` say so (without the key: llama.cpp's default, BOS for ``llama-bpe`` only).

    SentencePiece (``"llama"``): a BPE model with byte fallback over the tokens, its merges derived from the scores
    (``sentencepiece_merges``); spaces as "▁" and a "▁" before the text and after each added token where
    ``add_space_prefix`` says so (default true), and that one space stripped again when decoding; control and
    unknown tokens (types 3, 2) as special added tokens, user-defined ones (4) as plain added tokens; BOS / EOS as
    ``add_bos_token`` / ``add_eos_token`` say (without the key: BOS, as llama.cpp adds it). llama.cpp reads no
    pre-tokenizer for SentencePiece, and neither do we (``tokenizer.ggml.pre`` is ignored).

    ValueError for any other tokenizer model or pre-tokenizer: a guessed tokenizer would encode prompts the model
    never saw.
    """
    from tokenizers import Tokenizer

    f = open_gguf(path)
    kind = f.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        taken = " and ".join(f"{k!r} ({v})" for k, v in SUPPORTED_TOKENIZER_MODELS.items())
        raise ValueError(f"{f.path}: tokenizer model {kind!r} is not supported; specdec builds {taken}")
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{f.path}: the metadata lacks tokenizer.ggml.tokens")
    tokens = list(tokens)
    types = list(f.get("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens)))
    build = _byte_level if kind == "gpt2" else _sentencepiece
    spec = {"version": "1.0", "truncation": None, "padding": None, **build(f, tokens, types)}
    try:
        return Tokenizer.from_str(json.dumps(spec))
    except Exception as e:  # tokenizers raises its own Exception subclass
        raise ValueError(f"{f.path}: cannot build the tokenizer from its metadata: {e}") from e


def _byte_level(f: GGUFFile, tokens: list[str], types: list[int]) -> dict:
    pre = f.get("tokenizer.ggml.pre")
    if not pre:
        log.warning("%s: no tokenizer.ggml.pre; pre-tokenizing as llama.cpp's 'default' (regenerate the file)", f.path)
        pre = "default"
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise ValueError(
            f"{f.path}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    merges = [m.split(" ", 1) for m in f.get("tokenizer.ggml.merges", [])]
    return {
        "added_tokens": _added_tokens(f, tokens, types, special=(TOKEN_TYPE_CONTROL,)),
        "normalizer": {"type": "NFC"} if pre == "qwen2" else None,
        "pre_tokenizer": _pre_tokenizer(pre),
        "post_processor": _post_processor(f, tokens, add_bos=pre in _LLAMA3_PRES),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": _bpe(tokens, merges, ignore_merges=pre in _LLAMA3_PRES),
    }


def _sentencepiece(f: GGUFFile, tokens: list[str], types: list[int]) -> dict:
    scores = f.get("tokenizer.ggml.scores")
    if scores is None:
        log.warning("%s: no tokenizer.ggml.scores; every merge ties, so the lower token id merges first", f.path)
        scores = [0.0] * len(tokens)
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    escape = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    unescape = {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}
    strip = {"type": "Strip", "content": " ", "start": 1, "stop": 0}  # the prefix space, once, at the very start
    unk = f.get("tokenizer.ggml.unknown_token_id")
    return {
        "added_tokens": _added_tokens(f, tokens, types, special=(TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)),
        # (a normalizer, not a pre-tokenizer: it runs on each stretch of text between added tokens, so each gets its
        # "▁", llama.cpp's is_prev_special; and text that starts with spaces keeps them all: "  a" is "▁▁▁a")
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}] * prefix + [escape]},
        "pre_tokenizer": None,
        "post_processor": _post_processor(f, tokens, add_bos=True),
        "decoder": {
            "type": "Sequence",
            "decoders": [unescape, {"type": "ByteFallback"}, {"type": "Fuse"}] + [strip] * prefix,
        },
        "model": {
            **_bpe(tokens, sentencepiece_merges(tokens, scores), ignore_merges=False),
            "unk_token": tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None,
            "fuse_unk": True,
            "byte_fallback": True,
        },
    }


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[list[str]]:
    """Merges under which ``tokenizers``' BPE tokenizes as llama.cpp's SPM tokenizer: every cut of a token into two
    tokens, ranked by the score of the token the two make, highest first (SentencePiece BPE's order, as
    transformers' SentencePieceExtractor ranks them). BPE then joins, of the pairs it sees, the one of best rank,
    which is the one llama.cpp joins. Equal scores rank the lower token id first (llama.cpp takes the leftmost
    pair; no ranking can say that, and real vocabularies score their normal tokens apart). transformers ranks a
    Gemma file's merges by token id alone; llama.cpp, and we, by score.

    Shapes: ``tokens``, ``scores`` [num_tokens] -> [num_merges] pairs ``[left, right]``.
    """
    ids = {tok: i for i, tok in enumerate(tokens)}  # (a repeated text is its last id, as in llama.cpp)
    ranked = []
    for tok, i in ids.items():
        for cut in range(len(tok) - 1, 0, -1):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, left, right))
    ranked.sort(key=lambda m: m[:2])  # (stable: one token's cuts stay longer left piece first)
    return [[left, right] for _, _, left, right in ranked]


def _bpe(tokens: list[str], merges: list, ignore_merges: bool) -> dict:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": "",
        "end_of_word_suffix": "",
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": ignore_merges,
        "vocab": {tok: i for i, tok in enumerate(tokens)},
        "merges": merges,
    }


def _added_tokens(f: GGUFFile, tokens: list[str], types: list[int], special: tuple[int, ...]) -> list[dict]:
    """The tokens matched whole before the model sees the text: those of a type in ``special`` as special tokens,
    user-defined ones as plain added tokens. In a Phi-3 file (by ``general.name``, as llama.cpp tells), each takes
    the whitespace after it (``rstrip``, as Phi-3's tokenizer.json), but ``_PHI3_UNSTRIPPED``."""
    phi3 = any(name in str(f.get("general.name", "")).lower() for name in ("phi-3", "phi3"))
    return [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": phi3 and tok not in _PHI3_UNSTRIPPED,
            "normalized": False,
            "special": ty in special,
        }  # fmt: skip
        for i, (tok, ty) in enumerate(zip(tokens, types))
        if ty in special or ty == TOKEN_TYPE_USER_DEFINED
    ]


def _post_processor(f: GGUFFile, tokens: list[str], add_bos: bool) -> dict | None:
    """BOS before and EOS after every encoding, as far as ``add_bos_token`` / ``add_eos_token`` ask for them (where
    the file has no such key: ``add_bos``, and no EOS)."""

    def added(end: str, default: bool) -> list[tuple[str, int]]:
        token_id = f.get(f"tokenizer.ggml.{end}_token_id")
        if token_id is None or not f.get(f"tokenizer.ggml.add_{end}_token", default):
            return []
        if not (isinstance(token_id, int) and 0 <= token_id < len(tokens)):
            raise ValueError(f"{f.path}: tokenizer.ggml.{end}_token_id {token_id!r} is not a token of its vocabulary")
        return [(tokens[token_id], int(token_id))]

    bos, eos = added("bos", add_bos), added("eos", False)
    if not bos and not eos:
        return None

    def specials(ends):
        return [{"SpecialToken": {"id": t, "type_id": 0}} for t, _ in ends]

    single = specials(bos) + [{"Sequence": {"id": "A", "type_id": 0}}] + specials(eos)
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}}] + specials(eos)
    special = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in bos + eos}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}


def gguf_special_tokens(path: str | Path) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` -> their text ("" when the file names none): the
    variables a chat template sees."""
    f = open_gguf(path)
    tokens = f.get("tokenizer.ggml.tokens") or []
    out = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = f.get(f"tokenizer.ggml.{key}_token_id")
        out[f"{name}_token"] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else ""
    return out


def load_tokenizer(model: str | Path):
    """The ``tokenizers.Tokenizer`` of an HF directory (its ``tokenizer.json``) or a GGUF file (built from its
    metadata); None when the model has none."""
    from tokenizers import Tokenizer

    from spec_engine.models.gguf import gguf_path_or_none

    if gguf_path_or_none(model) is not None:
        return gguf_tokenizer(model)
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass on bad JSON
        raise ValueError(f"corrupt tokenizer {path}: {e}") from e


def token_texts(model: str | Path) -> list[str] | None:
    """Each token id's text, from a GGUF file's ``tokenizer.ggml.tokens`` (no tokenizer built) or an HF directory's
    tokenizer (its added tokens included); None where the model carries no tokenizer. Two models whose drafts and
    verifies exchange token ids must agree on these, whatever their merges (which only decide how text is cut)."""
    from spec_engine.models.gguf import gguf_path_or_none

    if gguf_path_or_none(model) is not None:
        return open_gguf(model).get("tokenizer.ggml.tokens")
    tok = load_tokenizer(model)
    if tok is None:
        return None
    vocab = tok.get_vocab(with_added_tokens=True)  # {text: id}
    texts = [""] * (max(vocab.values(), default=-1) + 1)
    for text, i in vocab.items():
        texts[i] = text
    return texts


def gguf_chat_template(path: str | Path) -> str | None:
    """The file's ``tokenizer.chat_template`` (a Jinja source), or None."""
    return open_gguf(path).get("tokenizer.chat_template")


__all__ = [
    "SUPPORTED_PRE_TOKENIZERS",
    "SUPPORTED_TOKENIZER_MODELS",
    "gguf_chat_template",
    "gguf_special_tokens",
    "gguf_tokenizer",
    "load_tokenizer",
    "sentencepiece_merges",
    "token_texts",
]
