"""``gguf_tokenizer`` against references: transformers' own reading of SmolLM2's GGUF file (encode and decode of tricky
and random text, decode of arbitrary ids), and tokenizer.json files shaped as a model's own for the pre-tokenizers
llama.cpp names (their defaults where a key is missing are llama.cpp's). SentencePiece files (written here, with a
vocabulary trained here) against transformers' reading of them, and Llama 2's vocabulary against llama.cpp's own test
vectors where ``$LLAMA_CPP_DIR`` has them. Real-model tests are skipped with one line when ``pull("smollm2")`` does
not work."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import gguf
import pytest
from gguf_files import (
    SPM_CONTROL,
    SPM_USER_DEFINED,
    add_tokenizer,
    chatml_tokenizer,
    spm_metadata,
    tokenizer_metadata,
    write_gguf,
)
from tiny_models import make_model
from tokenizers import Tokenizer, pre_tokenizers

from spec_engine import LLM, SamplingParams
from spec_engine.cli import main
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


# --- SentencePiece (tokenizer.ggml.model "llama"), against transformers' reading of the same file -----------------

SPM_TEXTS = [
    "hello world",
    " hello",
    "  hello  world  ",
    "trailing   ",
    "the theme\nof these\n\nthree\tis there\r\n",
    "numbers 12345 and 2024, x = 3.14; 0",
    "naïve café déjà vu Ελληνικά ελληνικά",
    "<s>the</s> <unk>hello",
    "<|user|>\nhello server<|end|>\n<|assistant|>\n",
    "x<|end|>y <|user|>  <|end|>",
    "<tool>fib(n)[[2]] ]] [[ <unused0>",
    *TRICKY,
]
SPM_CORPUS_WORDS = ["hello", " hello", "the", " theme", " these", " three", "fib(n", "12345", " cafe", "ελληνικά"]
SPM_PIECES = [*SPM_CONTROL, *SPM_USER_DEFINED, "<s>", "</s>", " the", "hello", " ", "  ", "\n", "12", "é", "🙂"]


def _spm_file(path: Path, meta: dict, arch: str, name: str | None = None) -> Path:
    """A GGUF file holding only ``meta``'s tokenizer metadata, under ``arch`` (which picks transformers' builder) and
    ``general.name`` ``name`` (absent where None)."""
    w = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    add_tokenizer(w, meta)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture(scope="module", params=["llama", "gemma"])
def spm_tokenizers(request, tmp_path_factory):
    """(ours, transformers', the metadata) for a SentencePiece file as Llama 2's (a "▁" before the text) or as
    Gemma's (``add_space_prefix`` false). transformers picks its builder by architecture: for "llama" it puts the "▁"
    before the text with Metaspace(prepend_scheme="first"), which llama.cpp does not do (it puts one before text that
    already starts with a space, and after every added token: test_spm_space_prefix_is_llama_cpps); its "phi3"
    builder does as llama.cpp and as Llama 2's own tokenizer.json (Prepend + Replace), so the reference reads the
    file as "phi3". Its Gemma builder ranks merges by token id, not score: this vocabulary scores in id order."""
    gemma = request.param == "gemma"
    meta = spm_metadata(gemma)
    path = _spm_file(tmp_path_factory.mktemp("spm") / "t.gguf", meta, "gemma2" if gemma else "phi3")
    from transformers import AutoTokenizer

    return gguf_tokenizer(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), meta


def _spm_random_texts(rng: random.Random, n: int) -> list[str]:
    pick = [lambda: rng.choice(ALPHABET), lambda: rng.choice(SPM_PIECES), lambda: rng.choice(SPM_CORPUS_WORDS)]
    return ["".join(rng.choice(pick)() for _ in range(rng.randint(1, 20))) for _ in range(n)]


def _spm_cases(tok: Tokenizer) -> tuple[list[str], list[list[int]]]:
    """Texts: ``SPM_TEXTS`` and random ones; id sequences: UTF-8 cut in byte tokens, specials among them, random."""
    rng = random.Random(0)
    byte = [tok.token_to_id(f"<0x{b:02X}>") for b in "中🙂é".encode()]
    num_tokens = tok.get_vocab_size()
    cut = [byte[:k] for k in range(1, len(byte) + 1)] + [byte[1:], byte[:2] + [tok.token_to_id("<|end|>")] + byte[2:]]
    draw = [lambda: rng.randrange(num_tokens), lambda: rng.choice(byte), lambda: rng.randrange(6)]
    ids = [[rng.choice(draw)() for _ in range(rng.randint(0, 12))] for _ in range(200)]
    return SPM_TEXTS + _spm_random_texts(rng, 300), cut + ids


def test_spm_matches_transformers(spm_tokenizers):
    ours, ref, _ = spm_tokenizers
    assert ours.get_vocab_size() == len(ref)
    assert _mismatches(ours, ref, *_spm_cases(ours)) == []


def test_spm_round_trips(spm_tokenizers):
    """Text without added tokens decodes back to itself (bytes outside the vocabulary through byte tokens); BOS is
    added and skipped."""
    ours, _, meta = spm_tokenizers
    texts, _ = _spm_cases(ours)
    for text in texts:
        if not any(t in text for t in [*SPM_CONTROL, *SPM_USER_DEFINED, "<s>", "</s>", "<unk>", "<bos>", "<eos>"]):
            ids = ours.encode(text).ids
            assert ids[0] == meta["bos"] and ours.decode(ids) == text, text
    pieces = {ours.id_to_token(i) for i in ours.encode("🙂 🚀", add_special_tokens=False).ids}
    assert {p for p in pieces if not p.startswith("<0x")} == {"▁"}


def _rank_by_left_score(spec: dict, meta: dict) -> None:
    score = dict(zip(meta["tokens"], meta["scores"]))
    spec["model"]["merges"] = sorted(spec["model"]["merges"], key=lambda m: -score[m[0]])


def _no_space_prefix(spec: dict, meta: dict) -> None:
    spec["normalizer"]["normalizers"] = spec["normalizer"]["normalizers"][-1:]  # (Gemma's: Replace alone)
    spec["decoder"]["decoders"] = spec["decoder"]["decoders"][:3]


def _user_defined_not_added(spec: dict, meta: dict) -> None:
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in SPM_USER_DEFINED]


@pytest.mark.parametrize("plant", [_rank_by_left_score, _no_space_prefix, _user_defined_not_added])
def test_spm_comparison_catches_a_planted_bug(spm_tokenizers, plant):
    ours, ref, meta = spm_tokenizers
    if plant is _no_space_prefix and meta["add_space_prefix"] is False:
        pytest.skip("Gemma's tokenizer has no space prefix to lose")
    spec = json.loads(ours.to_str())
    plant(spec, meta)
    assert _mismatches(Tokenizer.from_str(json.dumps(spec)), ref, *_spm_cases(ours))


@pytest.mark.parametrize("gemma, text, pieces", [
    (False, "  hello", ["<s>", "▁", "▁", "▁hello"]),
    (False, "<|user|>hello<|end|> hello", ["<s>", "<|user|>", "▁hello", "<|end|>", "▁", "▁hello"]),
    (False, "<tool>hello", ["<s>", "<tool>", "▁hello"]),
    (True, " hello<|end|>hello", ["<bos>", "▁hello", "<|end|>", "he", "llo"]),
])  # fmt: skip
def test_spm_space_prefix_is_llama_cpps(tmp_path, gemma, text, pieces):
    """llama.cpp puts one "▁" before the text and after every added token (``is_prev_special``), however many
    spaces the text starts with, unless ``add_space_prefix`` is false (these pieces are what llama.cpp's
    ``llama_tokenize`` gives for this vocabulary)."""
    tok = gguf_tokenizer(_spm_file(tmp_path / "t.gguf", spm_metadata(gemma), "llama"))
    assert [tok.id_to_token(i) for i in tok.encode(text).ids] == pieces


@pytest.mark.parametrize("name, pieces", [
    ("Phi-3-mini-4k-instruct", ["<s>", "<|user|>", "▁hello", "<|end|>", "<|assistant|>", "<s>", "▁", "▁x"]),
    ("TinyLlama", ["<s>", "<|user|>", "▁", "<0x0A>", "he", "llo", "<|end|>", "▁", "<0x0A>", "<|assistant|>", "▁",
                   "<0x0A>", "<s>", "▁", "▁x"]),
])  # fmt: skip
def test_phi3_added_tokens_take_the_whitespace_after_them(tmp_path, name, pieces):
    """llama.cpp (keyed on ``general.name``) and Phi-3's tokenizer.json strip the whitespace after an added token, but
    after ``<s>``, ``<unk>`` and ``<|endoftext|>`` (these pieces are what llama.cpp's ``llama_tokenize`` gives)."""
    tok = gguf_tokenizer(_spm_file(tmp_path / "t.gguf", spm_metadata(), "phi3", name))
    assert [tok.id_to_token(i) for i in tok.encode("<|user|>\nhello<|end|>\n<|assistant|>\n<s> x").ids] == pieces


def test_unsupported_tokenizer_model_is_named(tmp_path):
    meta = {**spm_metadata(), "model": "t5"}
    with pytest.raises(ValueError, match=r"tokenizer model 't5'.*'gpt2' \(byte-level BPE\).*'llama' \(SentencePiece\)"):
        gguf_tokenizer(_spm_file(tmp_path / "t.gguf", meta, "t5"))


# --- end to end: a tiny random-weight Llama whose GGUF file carries a SentencePiece tokenizer ----------------------

# TinyLlama's chat shape, on this vocabulary's control tokens
SPM_CHAT = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("family, arch", [("llama_gqa", "llama"), ("gemma2", "gemma2")])
def test_spm_gguf_runs_through_llm_chat_and_the_cli(tmp_path, capsys, family, arch):
    """Llama 2's shape of vocabulary in a Llama file, Gemma's (no space prefix) in a Gemma 2 file."""
    meta = spm_metadata(gemma=arch == "gemma2")
    hf = make_model(tmp_path / "hf", family, vocab_size=len(meta["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, arch=arch, tokenizer=meta, chat_template=SPM_CHAT)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    out = llm.generate(["hello world"], greedy, use_tqdm=False)[0]
    assert out.prompt_token_ids == gguf_tokenizer(path).encode("hello world").ids
    assert out.prompt_token_ids[0] == meta["bos"] and len(out.outputs[0].token_ids) == 5
    chat = llm.chat([{"role": "user", "content": "hello server"}], greedy, use_tqdm=False)[0]
    assert chat.prompt == meta["tokens"][meta["bos"]] + "<|user|>\nhello server<|end|>\n<|assistant|>\n"
    assert chat.prompt_token_ids[:2] == [meta["bos"], meta["tokens"].index("<|user|>")]
    assert chat.prompt_token_ids.count(meta["bos"]) == 1  # the template's; encoding adds no other
    assert len(chat.outputs[0].token_ids) == 5
    for flag, text in (("--prompt", "hello world"), ("--chat", "hello server")):
        argv = ["generate", "--model", str(path), flag, text, "--max-tokens", "4", "--dtype", "float32"]
        assert main(argv) == 0
        assert "\n[specdec] " in capsys.readouterr().out


# --- Llama 2's vocabulary (32000 tokens) against llama.cpp's own test vectors --------------------------------------


def test_llama2_vocabulary_matches_llama_cpps_test_vectors():
    """llama.cpp's tests/test-tokenizer-0 inputs and ids for ``models/ggml-vocab-llama-spm.gguf`` (Llama 2's
    vocabulary, tokenized without BOS), read from ``$LLAMA_CPP_DIR`` (a llama.cpp checkout); skipped without one."""
    root = Path(os.environ.get("LLAMA_CPP_DIR", "")) / "models"
    path = root / "ggml-vocab-llama-spm.gguf"
    if not os.environ.get("LLAMA_CPP_DIR") or not path.is_file():
        pytest.skip("no $LLAMA_CPP_DIR/models/ggml-vocab-llama-spm.gguf (set LLAMA_CPP_DIR to a llama.cpp checkout)")
    texts = path.with_suffix(".gguf.inp").read_text().split("\n__ggml_vocab_test__\n")[:-1]
    ids = [[int(i) for i in line.split()] for line in path.with_suffix(".gguf.out").read_text().splitlines()]
    assert len(texts) == len(ids) > 40
    tok = gguf_tokenizer(path)
    assert [tok.encode(text, add_special_tokens=False).ids for text in texts] == ids
