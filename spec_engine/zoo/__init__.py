"""The embedded default model pair, trained by ``python -m spec_engine.training.train``."""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).parent / "models"


def default_model_paths() -> tuple[str, str]:
    """(target_dir, draft_dir) of the pair shipped inside the package."""
    target, draft = MODELS_DIR / "target", MODELS_DIR / "draft"
    for d in (target, draft):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(
                f"the default model pair is missing ({d}); run: python -m spec_engine.training.train"
            )
    return str(target), str(draft)


# The targets the project ships drafters for, recognised by their architecture: (model_type, layers, hidden size,
# MLP width, query heads, KV heads, vocabulary size, RoPE theta). The rule is the config, not a weight hash, so the
# HF export, the GGUF file (any quantization) and the pulled registry copy of a model all match; a fine-tune of the
# same architecture matches too and gets the head (lossless: the target decides every token; only acceptance drops).
SMOLLM2_135M = ("llama", 30, 576, 1536, 9, 3, 49152, 100000.0)
SHIPPED_DRAFTERS = {  # (signature, method) -> directory under MODELS_DIR
    (SMOLLM2_135M, "eagle"): "smollm2-eagle3",
}


def target_signature(cfg) -> tuple:
    """The architecture a ``ModelConfig`` is recognised by (``SMOLLM2_135M`` for SmolLM2-135M-Instruct)."""
    return (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size, float(cfg.rope.get("rope_theta", 10000.0)))  # fmt: skip


def shipped_drafter(target_config, method: str) -> str:
    """The directory of the drafter the project ships for a target, for a model-drafter method given no "model".

    ``method``: "draft_model" or "eagle" (the hybrid asks for the one it wraps). The embedded default target gets
    ``models/draft`` or ``models/eagle``; SmolLM2-135M-Instruct (``SMOLLM2_135M``) its EAGLE-3 head
    ``models/smollm2-eagle3``. Raises ValueError, naming what to pass, where nothing is shipped."""
    from spec_engine.models import ModelConfig

    sig = target_signature(target_config)
    embedded = MODELS_DIR / "target" / "config.json"
    if embedded.is_file() and sig == target_signature(ModelConfig.from_dir(embedded.parent)):
        found = {"draft_model": "draft", "eagle": "eagle"}.get(method)
    else:
        found = SHIPPED_DRAFTERS.get((sig, method))
    if found is None or not (MODELS_DIR / found / "config.json").is_file():
        what = "a draft model directory" if method == "draft_model" else "an EAGLE head directory"
        raise ValueError(f"no {method!r} drafter ships for this target ({sig[0]}, {sig[1]} layers, hidden "
                         f"{sig[2]}, vocab {sig[6]}): speculative_config with method={method!r} needs 'model': "
                         f"{what}")  # fmt: skip
    return str(MODELS_DIR / found)
