"""``gguf_tokenizer`` against references: transformers' own reading of SmolLM2's GGUF file (encode and decode of tricky
and random text, decode of arbitrary ids), and tokenizer.json files shaped as a model's own for the pre-tokenizers
llama.cpp names (their defaults where a key is missing are llama.cpp's). Real-model tests are skipped with one line
when ``pull("smollm2")`` does not work."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import gguf
import pytest
from gguf_files import chatml_tokenizer, tokenizer_metadata
from tokenizers import Tokenizer, pre_tokenizers

from spec_engine.models.gguf_tokenizer import gguf_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRICKY = [
    "",
    " ",
    "   leading spaces",
    "trailing spaces   ",
    "many          spaces\u3000\u00a0nbsp",
    "def f(x):\r\n\tif x:\r\n\t\treturn x  # CRLF\r\n    else:\n        pass\n\n\n",
    "\t\t\ttabs\t \t\n \n\r\r\n",
    "0 12 345 6789 3.14159 1,000,000 2024-01-01 ½ ² Ⅷ ٣٤ ①",
    "It's don't they're we've I'm you'll he'd IT'S DON'T THEY'RE We'Ve 's 'S ’s 'ſ",
    "日本語の文章。中文，标点！한국어 텍스트",
    "🙂🚀 👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽",
    "e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0364\u036b",  # combining marks (decomposed, NFD)
    "שלום עולם مرحبا بالعالم \u202eRTL override\u202c",
    "\U0010ffff\U000e0001\ufffe\uffff\ufffd\U0001f9ff\x00\x07\x7f\u0085\u2028",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "x<|im_end|>y <|im_start|> <|endoftext|><|endoftext|>",
    "<|im_start <|im_end |> < |im_end|> <|IM_END|>",
    "<repo_name>specdec<file_sep>a.py\n<jupyter_code>print(1)",
]
# pieces the random texts are made of: scripts, spaces and line ends, digits, contractions, specials
CODE_POINTS = [*range(32, 127), *range(0xA0, 0x180), *range(0x300, 0x310), *range(0x590, 0x600), *range(0x3040, 0x3100),
               *range(0x4E00, 0x4E40), *range(0x1F600, 0x1F620), 0x10FFFF]  # fmt: skip
ALPHABET = [chr(c) for c in CODE_POINTS]
PIECES = [*SPECIALS, " ", "  ", "\t", "\n", "\r\n", "'s", "'T", "'re", "0", "42", "12345", " the", "\u200d"]


def _random_texts(rng: random.Random, n: int) -> list[str]:
    pick = [lambda: rng.choice(ALPHABET), lambda: rng.choice(PIECES)]
    return ["".join(rng.choice(pick)() for _ in range(rng.randint(1, 30))) for _ in range(n)]


def _byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte (the byte-level alphabet's tokens)."""
    (chars, _), *_ = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    return [tok.token_to_id(c) for c in chars]


def _id_sequences(tok: Tokenizer, rng: random.Random, n: int) -> list[list[int]]:
    """Ids that split characters (a cut lead byte, an orphan continuation byte, a special token inside a character)
    and random ids, special ones and byte tokens among them."""
    im_end = tok.token_to_id("<|im_end|>")
    cut = [_byte_ids(tok, "中🙂é")[:k] for k in range(1, 9)]
    split = [_byte_ids(tok, "é")[1:], _byte_ids(tok, "🙂")[:2] + [im_end] + _byte_ids(tok, "🙂")[2:],
             tok.encode("ab").ids + _byte_ids(tok, "中")[:2] + tok.encode(" cd").ids]  # fmt: skip
    num_tokens, num_control = tok.get_vocab_size(), 17  # (SmolLM2's control tokens: ids 0-16)
    # (SmolLM2 has no token for a few control bytes: its encodings leave them out, as transformers' do)
    byte_tokens = [i for i in _byte_ids(tok, bytes(range(128)).decode() + "é中🙂") if i is not None]
    draw = [lambda: rng.randrange(num_tokens), lambda: rng.randrange(num_control), lambda: rng.choice(byte_tokens)]
    return cut + split + [[rng.choice(draw)() for _ in range(rng.randint(0, 12))] for _ in range(n)]


def _mismatches(ours: Tokenizer, ref, texts: list[str], id_seqs: list[list[int]]) -> list[str]:
    """Where ``ours`` (a ``tokenizers.Tokenizer``) and ``ref`` (a transformers tokenizer) disagree: the ids of each
    text, with and without special tokens added; the text of those ids and of each id sequence, special tokens kept
    and skipped."""
    out, encoded = [], []
    for text in texts:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add).ids
            if ids != ref.encode(text, add_special_tokens=add):
                out.append(f"encode({text!r}, add_special_tokens={add})")
            encoded.append(ids)
    for ids in encoded + id_seqs:
        for skip in (True, False):
            if ours.decode(ids, skip_special_tokens=skip) != ref.decode(ids, skip_special_tokens=skip):
                out.append(f"decode({ids}, skip_special_tokens={skip})")
    return out


# --- SmolLM2-135M-Instruct (pulled from the package registry) -----------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizers(smollm2):
    """(ours, transformers') for SmolLM2's GGUF. transformers' GGUF reader ignores ``tokenizer.ggml.pre`` and
    pre-tokenizes as GPT-2; SmolLM2's tokenizer.json (and llama.cpp's "smollm") put each digit apart first, so the
    reference gets that pre-tokenizer (test_gguf.py's test_smollm2_tokenizer checks digits against SmolLM2's own ids).
    Everything else (vocabulary, merges, special tokens, BOS, decoder) is transformers' reading of the file."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return gguf_tokenizer(smollm2), ref


def _smollm2_cases(tok: Tokenizer) -> tuple[list[str], list[list[int]]]:
    rng = random.Random(0)
    return TRICKY + _random_texts(rng, 300), _id_sequences(tok, rng, 300)


def test_smollm2_matches_transformers(smollm2_tokenizers):
    ours, ref = smollm2_tokenizers
    assert _mismatches(ours, ref, *_smollm2_cases(ours)) == []


def _drop_first_merge(spec: dict) -> None:
    spec["model"]["merges"] = spec["model"]["merges"][1:]  # "Ġ t": " the", " to"... take another path


def _gpt2_regex_only(spec: dict) -> None:
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _im_end_not_special(spec: dict) -> None:
    (tok,) = [t for t in spec["added_tokens"] if t["content"] == "<|im_end|>"]
    tok["special"] = False


@pytest.mark.parametrize("plant", [_drop_first_merge, _gpt2_regex_only, _im_end_not_special])
def test_the_comparison_catches_a_planted_bug(smollm2_tokenizers, plant):
    ours, ref = smollm2_tokenizers
    spec = json.loads(ours.to_str())
    plant(spec)
    assert _mismatches(Tokenizer.from_str(json.dumps(spec)), ref, *_smollm2_cases(ours))


# --- the pre-tokenizers llama.cpp names, against tokenizer.json files shaped as the models' own ---------------------

# Meta-Llama-3's tokenizer.json: this Split, then ByteLevel without its regex; its BPE model has "ignore_merges": true
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
WHOLE_WORD = "Ġzebra"  # in the vocabulary, but no merge makes it (Llama 3's tiktoken vocabulary has such tokens)


def _tokenizer_file(path: Path, meta: dict, add_bos: bool | None = None) -> Path:
    """A GGUF file holding only ``tokenizer_metadata``'s keys (``pre`` absent where None) and ``add_bos_token`` (absent
    where None)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if meta["pre"] is not None:
        w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["types"])
    w.add_token_merges(meta["merges"])
    w.add_bos_token_id(meta["tokens"].index("<|im_start|>"))
    w.add_eos_token_id(meta["tokens"].index("<|im_end|>"))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def _llama3_shaped() -> Tokenizer:
    spec = json.loads(chatml_tokenizer(SPECIALS, digits_apart=False).to_str())
    split = {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, byte_level]}
    spec["model"]["ignore_merges"] = True
    spec["model"]["vocab"][WHOLE_WORD] = len(spec["model"]["vocab"])
    return Tokenizer.from_str(json.dumps(spec))


def test_llama_bpe_takes_a_word_in_the_vocabulary_whole(tmp_path):
    """llama.cpp's llama-bpe (``ignore_merges``) and Llama 3's tokenizer.json emit a pre-token that is a token as that
    token, whether or not the merges reach it."""
    ref = _llama3_shaped()
    meta = tokenizer_metadata(ref, SPECIALS, "llama-bpe")
    ours = gguf_tokenizer(_tokenizer_file(tmp_path / "t.gguf", meta, add_bos=False))
    assert ref.encode(" zebra").ids == [ref.token_to_id(WHOLE_WORD)]
    for text in [" zebra", "a zebra, zebras!", *TRICKY, *_random_texts(random.Random(0), 100)]:
        assert ours.encode(text).ids == ref.encode(text).ids, text


@pytest.mark.parametrize("pre, add_bos, adds_bos", [("llama-bpe", None, True), ("llama-bpe", False, False),
                                                    ("smollm", None, False), ("qwen2", None, False),
                                                    ("qwen2", True, True)])  # fmt: skip
def test_bos_is_added_as_llama_cpp_adds_it(tmp_path, pre, add_bos, adds_bos):
    """``add_bos_token`` where the file has it, else llama.cpp's default for the pre-tokenizer (llama-bpe: BOS)."""
    meta = tokenizer_metadata(chatml_tokenizer(SPECIALS), SPECIALS, pre)
    tok = gguf_tokenizer(_tokenizer_file(tmp_path / "t.gguf", meta, add_bos))
    bos = tok.token_to_id("<|im_start|>")
    assert (tok.encode("hello").ids[0] == bos) == adds_bos
    assert tok.encode("hello", add_special_tokens=False).ids[0] != bos


@pytest.mark.parametrize("pre", ["smollm", "starcoder", "minerva-7b"])
def test_digits_apart_under_llama_cpps_names(tmp_path, pre):
    """The pre-tokenizers that split each digit first (llama.cpp's regex "\\p{N}", then GPT-2's), by the names
    llama.cpp reads."""
    ref = chatml_tokenizer(SPECIALS, digits_apart=True)
    ours = gguf_tokenizer(_tokenizer_file(tmp_path / "t.gguf", tokenizer_metadata(ref, SPECIALS, pre)))
    for text in TRICKY:
        assert ours.encode(text).ids == ref.encode(text).ids, text


# llama.cpp's "default" (also for a file without tokenizer.ggml.pre), worked by hand from llama-vocab.cpp's regex list.
# [\p{P}$+<=>^~|]+ cuts "it" "'" "s x " "=" " f" "(" "12345" ")!" " 2024"; GPT-2's regex cuts "s x " into "s" " x" " ";
# \p{N}+ takes the space off " 2024"; [0-9][0-9][0-9] cuts "12345" and "2024" into threes from the left.
DEFAULT_TEXT = "it's x = f(12345)! 2024"
DEFAULT_PIECES = ["it", "'", "s", " x", " ", "=", " f", "(", "123", "45", ")!", " ", "202", "4"]
GPT2_PIECES = ["it", "'s", " x", " =", " f", "(", "12345", ")!", " 2024"]  # GPT-2's regex alone: what it is not


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [text[start:end] for _, (start, end) in tok.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", ["default", None])
def test_default_pre_tokenizer_is_llama_cpps_regex_list(tmp_path, caplog, pre):
    """A file whose pre-tokenizer is ``default``, or that has none, splits text by llama.cpp's default regex list, not
    by GPT-2's regex; the missing key is warned about, as llama.cpp warns."""
    meta = tokenizer_metadata(chatml_tokenizer(SPECIALS, digits_apart=False), SPECIALS)
    with caplog.at_level(logging.WARNING, logger="spec_engine.models.gguf_tokenizer"):
        ours = gguf_tokenizer(_tokenizer_file(tmp_path / "t.gguf", {**meta, "pre": pre}))
    assert ("tokenizer.ggml.pre" in caplog.text) == (pre is None)
    assert _pieces(ours, DEFAULT_TEXT) == DEFAULT_PIECES
    gpt2 = gguf_tokenizer(_tokenizer_file(tmp_path / "gpt2.gguf", {**meta, "pre": "gpt-2"}))
    assert _pieces(gpt2, DEFAULT_TEXT) == GPT2_PIECES
    assert ours.decode(ours.encode(DEFAULT_TEXT).ids) == DEFAULT_TEXT
