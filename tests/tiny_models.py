"""Tiny HF model directories made in the test session: random checkpoints (transformers ``save_pretrained``) and a
byte-level BPE ``tokenizer.json`` (HF ``tokenizers``). No hub, no downloads."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import torch

ARCHS = {
    "llama_gqa": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama3_rope": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },  # fmt: skip
    ),
    "qwen2_tied": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # a window longer than max_position_embeddings' 512 never binds; test_families sets a shorter one
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=4096),
    "phi3": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=2, pad_token_id=None),
    # small caps and window, so that they bind on a tiny random model; query_pre_attn_scalar = head_dim, as llama.cpp
    # assumes for any Gemma but the 27B ones
    "gemma2": dict(
        model_type="gemma2",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=5.0,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
    ),
}


def hf_config(arch: str, vocab_size: int, hidden: int, layers: int, **over):
    from transformers import AutoConfig

    spec = dict(ARCHS[arch])
    model_type = spec.pop("model_type")
    kw = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, vocab_size=vocab_size,
              max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
    kw.update(spec)
    kw.update(over)
    return AutoConfig.for_model(model_type, **kw)


def make_model(path: Path, arch: str, *, vocab_size: int = 96, hidden: int = 64, layers: int = 2, seed: int = 0,
               logit_scale: float = 1.0, norm_noise: float = 0.0, tokenizer_config: dict | None = None,
               **over) -> Path:  # fmt: skip
    """A random HF checkpoint. ``logit_scale`` sharpens the output distribution (random inits are near uniform);
    ``norm_noise`` adds N(0, norm_noise) to every norm weight (HF initialises them all alike).

    ``over`` overrides config fields (e.g. ``max_position_embeddings=256``); ``tokenizer_config`` is written as
    ``tokenizer_config.json`` (e.g. ``{"chat_template": ...}``). The same arguments give the same weights.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, vocab_size, hidden, layers, **over))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif norm_noise:
                p.add_(torch.randn_like(p) * norm_noise)
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.save_pretrained(path)
    if tokenizer_config is not None:
        (Path(path) / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def make_noisy_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> Path:
    """The target with Gaussian noise on every weight: a draft that agrees often but not always."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise * p.std())
    model.save_pretrained(dst)
    return dst


# One speculative config per kind of drafter, for tests that check a property holds whatever drafts (None: plain);
# "draft_model" entries take their model from ``drafter_config``
DRAFTER_MODES = {
    "none": None,
    "chain4": {"method": "draft_model", "num_speculative_tokens": 4},
    "tree": {"method": "draft_model", "num_speculative_tokens": 3, "tree": [2, 2, 1]},
    "adaptive": {"method": "draft_model"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix"},
}


def drafter_config(mode: str, draft: Path) -> dict | None:
    """``DRAFTER_MODES[mode]`` with ``draft`` as its model where it takes one."""
    spec = DRAFTER_MODES[mode]
    return spec and dict(spec, **({"model": str(draft)} if spec["method"] == "draft_model" else {}))


# Mixed scripts so the merges cover multi-byte UTF-8 and random models emit partial characters now and then.
CORPUS = [
    "the quick brown fox jumps over the lazy dog. ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "speculative decoding drafts tokens and the target verifies them in one pass. ",
    "naïve café déjà vu — 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский. ",
    "<|system|>\n<|user|>\n<|assistant|>\nhello world, hello server, hello client.\n",
]


NEAR_TIE = 1e-3  # a top-2 logit margin below this is a coin toss between two float orders of summation


def hf_trusted_greedy(model, prompt: tuple[int, ...], n: int) -> tuple[list[int], int]:
    """HF ``model``'s greedy tokens after ``prompt`` and how many of them are trustworthy: up to and including the
    first near-tie (top-2 margin below ``NEAR_TIE``), which may go either way, and on which everything after it
    depends."""
    out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    for i, scores in enumerate(out.scores):
        top2 = scores[0].float().topk(2).values
        if top2[0] - top2[1] < NEAR_TIE:
            return tokens, i + 1
    return tokens, n


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


@contextlib.contextmanager
def serve_in_thread(app, **config):
    """A real uvicorn server for ``app`` on a free loopback port, in a background thread; yields the port; stopped
    and joined on exit. ``config`` goes to ``spec_engine.server.app.uvicorn_config`` (log_level, max_header_bytes)."""
    import uvicorn

    from spec_engine.server.app import uvicorn_config

    server = uvicorn.Server(uvicorn_config(app, port=0, lifespan="on", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()
