"""Loading models from HF-format directories (config.json + *.safetensors, sharded or not) or GGUF files, and
saving HF-format directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from spec_engine.models.config import ModelConfig, rope_inv_freq
from spec_engine.models.llama import LlamaForCausalLM


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"corrupt shard index {index}: {e}") from e
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (PyTorch .bin checkpoints are not supported)")
    return files


def load_model(model: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LlamaForCausalLM:
    """Build the model from an HF directory (``config.json`` + safetensors) or a GGUF file (``*.gguf``, weights
    dequantized to ``dtype``), checking every name and shape."""
    from spec_engine.models.gguf import gguf_path_or_none, read_gguf

    gguf_file = gguf_path_or_none(model)
    if gguf_file is not None:
        cfg, state = read_gguf(gguf_file, dtype)
        return build_model(cfg, state, dtype=dtype, device=device, source=gguf_file)
    model_dir = Path(model)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    cfg = ModelConfig.from_dir(model_dir)
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        if not path.is_file():
            raise FileNotFoundError(f"missing weight shard {path}")
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt weight file {path}: {e}") from e
    return build_model(cfg, state, dtype=dtype, device=device, source=model_dir)


def build_model(
    cfg: ModelConfig, state: dict[str, torch.Tensor], *, dtype: torch.dtype, device: str, source: str | Path
) -> LlamaForCausalLM:
    """The model of ``cfg`` holding the HF-named weights of ``state`` (in ``dtype``), checking every name and shape;
    ``source`` names the checkpoint in errors."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint {source} lacks {len(missing)} weights, e.g. {missing[:3]}")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(state[name].shape)} != expected {tuple(tensor.shape)}"
            )
    model.load_state_dict({k: state[k].to(dtype) for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)  # built on meta above; buffers are not in the file
    return model.to(device).eval().requires_grad_(False)


def save_model(
    model: LlamaForCausalLM, config: dict, out_dir: str | Path, *, dtype: torch.dtype = torch.float16
) -> None:
    """Write an HF-format directory: config.json, model.safetensors (in ``dtype``) and generation_config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config, torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"), "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
