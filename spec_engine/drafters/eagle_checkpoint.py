"""EAGLE head checkpoints: a head directory (config.json + *.safetensors) in either published layout (EAGLE-1/2's
"eagle", EAGLE-3's "eagle3"; spec_engine/drafters/eagle.py describes both), read and checked against its target, and
written."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from spec_engine.drafters.eagle import EagleHead
from spec_engine.models import LlamaForCausalLM, ModelConfig
from spec_engine.models.config import rope_inv_freq


def _strip(name: str) -> str:
    return name.removeprefix("model.")


# weights published heads carry that the head does not use: EAGLE-3's target-to-draft mask (d2t says the same) and
# EAGLE-1's copy of the target's embedding (the head reads the target's own)
UNUSED_HEAD_WEIGHTS = frozenset({"t2d", "embed_tokens.weight"})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load_eagle_head(head_dir: str | Path, target: LlamaForCausalLM, *, dtype: torch.dtype = torch.float32,
                    device: str = "cpu") -> EagleHead:  # fmt: skip
    """Load a head directory (config.json + *.safetensors) in either published layout, checked against ``target``.

    Raises ValueError when the head does not fit the target: another hidden size, vocabulary, or missing weights."""
    head_dir = Path(head_dir)
    if not (head_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {head_dir}: not an EAGLE head directory")
    try:
        raw = json.loads((head_dir / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{head_dir / 'config.json'}: {e}") from None
    files = sorted(head_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {head_dir}")
    state = {}
    for f in files:
        try:
            state.update({_strip(k): v for k, v in load_file(str(f)).items()})
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt weight file {f}: {e}") from None
    layout = "eagle3" if any(k.startswith("midlayer.") for k in state) else "eagle"
    if layout == "eagle" and not any(k.startswith("layers.0.") for k in state):
        raise ValueError(f"{head_dir} is no EAGLE head: it has neither 'layers.0.*' (EAGLE) nor 'midlayer.*' (EAGLE-3)")
    if not isinstance(raw, dict):
        raise ValueError(f"{head_dir / 'config.json'} must hold a JSON object")
    raw.setdefault("model_type", "llama")
    cfg = ModelConfig.from_dict(raw)
    tcfg = target.config
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"EAGLE head vocab ({cfg.vocab_size}) != target vocab ({tcfg.vocab_size}): the head was "
                         "trained for another target")  # fmt: skip
    eagle_cfg = raw.get("eagle_config") or {}
    if not isinstance(eagle_cfg, dict):
        raise ValueError(f"{head_dir / 'config.json'}: eagle_config must be a JSON object, got {eagle_cfg!r}")
    target_layers = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or raw.get("target_layers")
    if target_layers is not None and not (isinstance(target_layers, list) and all(_is_int(i) for i in target_layers)):
        raise ValueError(f"{head_dir / 'config.json'}: EAGLE-3 target layers must be a list of ints, got "
                         f"{target_layers!r}")  # fmt: skip
    draft_vocab_size = raw.get("draft_vocab_size")
    if draft_vocab_size is not None and not (_is_int(draft_vocab_size) and 1 <= draft_vocab_size <= cfg.vocab_size):
        raise ValueError(f"{head_dir / 'config.json'}: draft_vocab_size must be an int in [1, {cfg.vocab_size}], got "
                         f"{draft_vocab_size!r}")  # fmt: skip
    if layout == "eagle" and draft_vocab_size not in (None, cfg.vocab_size):  # its logits would be read as target ids
        raise ValueError(f"{head_dir}: a reduced draft vocabulary (draft_vocab_size={draft_vocab_size}) needs the "
                         "EAGLE-3 layout's d2t map to the target's ids")  # fmt: skip
    target_hidden = raw.get("target_hidden_size") or cfg.hidden_size
    if target_hidden != tcfg.hidden_size or (layout == "eagle" and cfg.hidden_size != tcfg.hidden_size):
        raise ValueError(f"EAGLE head expects target hidden size {target_hidden}, the target has {tcfg.hidden_size}")
    if target_layers is not None and not all(0 <= i < tcfg.num_hidden_layers for i in target_layers):
        raise ValueError(f"EAGLE-3 target layers {target_layers} outside the target's {tcfg.num_hidden_layers}")
    with torch.device("meta"):
        head = EagleHead(cfg, layout, target, fc_bias="fc.bias" in state, draft_vocab_size=draft_vocab_size,
                         target_layers=target_layers, own_lm_head="lm_head.weight" in state,
                         own_embedding=layout == "eagle3" and "embed_tokens.weight" in state,
                         norm_before_residual=bool(raw.get("norm_before_residual")),
                         normed=layout == "eagle" and "layers.0.input_layernorm.weight" in state)  # fmt: skip
    expected = dict(head.state_dict())
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"EAGLE head {head_dir} ({layout} layout) lacks {len(missing)} weights, e.g. {missing[:3]}")
    unused = sorted(set(state) - set(expected) - UNUSED_HEAD_WEIGHTS)
    if unused:  # (a second layer's weights, say: the head would draft as a one-layer head, badly and silently)
        raise ValueError(f"EAGLE head {head_dir} ({layout} layout) holds {len(unused)} weights this head has no place "
                         f"for, e.g. {unused[:3]}")  # fmt: skip
    for name, t in expected.items():
        w = state[name]
        if tuple(w.shape) != tuple(t.shape):
            raise ValueError(f"EAGLE head weight {name}: shape {tuple(w.shape)} != expected {tuple(t.shape)}")
        if name == "d2t":  # offsets: a float or bool tensor would map draft tokens to other ids than it says
            if w.is_floating_point() or w.is_complex() or w.dtype == torch.bool:
                raise ValueError(f"EAGLE-3 d2t must hold integer offsets, got {w.dtype}")
        elif not w.is_floating_point():
            raise ValueError(f"EAGLE head weight {name}: dtype {w.dtype} is no floating-point type")
        elif not bool(torch.isfinite(w).all()):  # NaN draft probabilities would void the rejection test's guarantee
            raise ValueError(f"EAGLE head weight {name} holds NaN or infinite values")
    cast = {k: state[k].long() if k == "d2t" else state[k].to(dtype) for k in expected}
    head.load_state_dict(cast, strict=False, assign=True)
    head.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    if layout == "eagle3":
        mapped = head.d2t + torch.arange(head.draft_vocab_size)
        if int(mapped.min()) < 0 or int(mapped.max()) >= tcfg.vocab_size:
            raise ValueError(f"EAGLE-3 d2t maps draft tokens outside the target vocabulary [0, {tcfg.vocab_size})")
        # two draft tokens on one target id: the native chains' q, scattered onto target ids, would lose one's mass,
        # and a draw would be verified against a probability it was not drawn with
        if mapped.unique().numel() != head.draft_vocab_size:
            raise ValueError("EAGLE-3 d2t maps two draft tokens to the same target token")
    return head.to(device).eval().requires_grad_(False)


def save_eagle_head(head: EagleHead, config: dict, out_dir: str | Path, *, dtype: torch.dtype = torch.float16) -> None:
    """Write a head directory in its published layout: config.json and model.safetensors (``dtype``, d2t int64)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() if k == "d2t" else v.detach().cpu().to(dtype).contiguous()
             for k, v in head.state_dict().items()}  # fmt: skip
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(config, torch_dtype=str(dtype).removeprefix("torch.")), indent=2)
                                     + "\n")  # fmt: skip
