"""Tiny HF model directories for tests: a byte-level BPE ``tokenizer.json`` and random Llama checkpoints.

Everything is built locally (``tokenizers`` training, transformers ``save_pretrained``): no hub, no downloads.
Typical use, in a session- or module-scoped fixture::

    tok = make_tokenizer(root / "target")                     # writes tokenizer.json, returns the Tokenizer
    make_tiny_llama(root / "target", tok.get_vocab_size(), layers=2, hidden=64, seed=0)
    make_tokenizer(root / "draft"); make_tiny_llama(root / "draft", tok.get_vocab_size(), layers=1, hidden=32, seed=1)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Mixed scripts so the merges cover multi-byte UTF-8 and random models emit partial characters now and then.
CORPUS = [
    "the quick brown fox jumps over the lazy dog. ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "speculative decoding drafts tokens and the target verifies them in one pass. ",
    "naïve café déjà vu — 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский. ",
    "<|system|>\n<|user|>\n<|assistant|>\nhello world, hello server, hello client.\n",
]


def make_tokenizer(path: str | Path, vocab_size: int = 300, corpus: list[str] | None = None):
    """Train a byte-level BPE on ``corpus`` and save it as ``path/tokenizer.json``; returns the ``Tokenizer``.

    Byte-level means every string encodes (no unknown tokens) and every id sequence decodes, with U+FFFD where a
    multi-byte character is cut.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator((corpus or CORPUS) * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok


def make_tiny_llama(
    path: str | Path,
    vocab: int,
    layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    *,
    logit_scale: float = 4.0,
    tokenizer_config: dict | None = None,
    **cfg,
) -> Path:
    """A random ``LlamaForCausalLM`` saved with ``save_pretrained`` at ``path``.

    ``logit_scale`` sharpens the output distribution (a random init is near uniform, so greedy would sit on ties).
    ``cfg`` overrides ``LlamaConfig`` fields (e.g. ``max_position_embeddings=256``, ``eos_token_id=3``).
    ``tokenizer_config`` is written as ``tokenizer_config.json`` (e.g. ``{"chat_template": ...}``).
    The same (vocab, layers, hidden, seed, cfg) gives the same weights, so two calls make identical checkpoints.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    kw = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)  # fmt: skip
    kw.update(cfg)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path
