"""The embedded default model pair, trained by ``python -m spec_engine.zoo.train``."""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).parent / "models"


def default_model_paths() -> tuple[str, str]:
    """(target_dir, draft_dir) of the pair shipped inside the package."""
    target, draft = MODELS_DIR / "target", MODELS_DIR / "draft"
    for d in (target, draft):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"the default model pair is missing ({d}); run: python -m spec_engine.zoo.train")
    return str(target), str(draft)
