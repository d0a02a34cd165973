"""Loading models from HF-format directories (config.json + *.safetensors, sharded or not) or GGUF files, and
saving HF-format directories."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from spec_engine.models.config import ModelConfig
from spec_engine.models.families import hf_state, model_class, weight_dtype
from spec_engine.models.llama import LlamaForCausalLM
from spec_kernels.types import check_activations


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


QUANTIZATIONS = ("gguf",)  # LLM(quantization=...): vLLM's name for a GGUF file's weights kept as stored


def default_quant_activations() -> str:
    """LLM(quant_activations=...)'s default: "int8" where this CPU multiplies int8 blocks with vector instructions
    (AVX2 with F16C, AVX512-VNNI, AMX tiles), "float" where only the scalar kernel would: 8-bit activations
    (llama.cpp's numerics, the same bits on every path) decode and verify faster than the float path there
    (bench/RESULTS.md, "8-bit activations")."""
    from spec_kernels.quant_linear import int8_path

    return "float" if int8_path() == "scalar" else "int8"


def load_model(
    model: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    quantization: str | None = None,
    quant_activations: str | None = None,
) -> LlamaForCausalLM:
    """Build the model from an HF directory (``config.json`` + safetensors) or a GGUF file (``*.gguf``, weights
    dequantized to ``dtype``), checking every name and shape. ``quantization="gguf"`` keeps a GGUF file's quantized
    matrices as stored (``load_gguf_quantized``), multiplied in the numeric mode ``quant_activations``
    (``spec_kernels.types.QUANT_ACTIVATIONS``: "float" or "int8"; None: ``default_quant_activations()``)."""
    from spec_engine.models.gguf import gguf_path_or_none, read_gguf

    gguf_file = gguf_path_or_none(model)
    if quant_activations is not None and quantization is None:
        raise ValueError(
            f"quant_activations={quant_activations!r} sets how quantized weights multiply: it needs quantization='gguf'"
        )
    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
        if gguf_file is None:
            raise ValueError(
                f"quantization='gguf' keeps a GGUF file's quantized weights, but {model} is not a GGUF file; "
                "leave quantization unset for HF checkpoints"
            )
        activations = check_activations(quant_activations or default_quant_activations())
        return load_gguf_quantized(gguf_file, dtype=dtype, device=device, activations=activations)
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
    return build_model(cfg, hf_state(cfg, state), dtype=dtype, device=device, source=model_dir)


def load_gguf_quantized(path: Path, *, dtype: torch.dtype, device: str, activations: str = "float") -> LlamaForCausalLM:
    """A GGUF checkpoint with its quantized matrices kept as the file stores them (``LlamaForCausalLM.quantized``),
    run by the native quantized kernels; norms and float tensors in ``dtype``. The modules' parameters of quantized
    names are NaN placeholders (a stride-0 view, no memory), except the embedding, kept dense in ``dtype`` too
    (drafters and lookups read it). The kernels are CPU ones: on another device the weights are dequantized to
    ``dtype`` at load, and a warning says so."""
    from spec_engine.models.gguf import read_gguf_raw
    from spec_kernels.types import QuantizedWeight

    cfg, raw = read_gguf_raw(path)
    if torch.device(device).type != "cpu":
        warnings.warn(
            f"quantization='gguf' runs the quantized kernels on CPU only: {path.name}'s weights are dequantized to "
            f"{str(dtype).removeprefix('torch.')} for {device}",
            stacklevel=3,
        )
        return build_model(cfg, {n: r.dequantize(weight_dtype(cfg, n, dtype)) for n, r in raw.items()}, dtype=dtype,
                           device=device, source=path)  # fmt: skip
    blocks = {n: QuantizedWeight(r.data, r.type_name, r.shape, activations) for n, r in raw.items() if r.quantized}
    nan = torch.full((), float("nan"), dtype=dtype)
    state = {n: nan.expand(r.shape) if n in blocks and n != "model.embed_tokens.weight"
             else r.dequantize(weight_dtype(cfg, n, dtype)) for n, r in raw.items()}  # fmt: skip
    model = build_model(cfg, state, dtype=dtype, device=device, source=path)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in blocks:
        blocks["lm_head.weight"] = blocks["model.embed_tokens.weight"]
    model.quantized = blocks
    return model


def build_model(
    cfg: ModelConfig, state: dict[str, torch.Tensor], *, dtype: torch.dtype, device: str, source: str | Path
) -> LlamaForCausalLM:
    """The model of ``cfg`` holding the HF-named weights of ``state`` (in ``dtype``), checking every name and shape;
    ``source`` names the checkpoint in errors."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint {source} lacks {len(missing)} weights, e.g. {missing[:3]}")
    # weights the model has no place for would be dropped and the output silently differ from the checkpoint's
    # (a Llama with attention_bias has an o_proj bias too): refused. RoPE's inverse frequencies are computed here.
    unused = sorted(k for k in set(state) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"checkpoint {source} holds {len(unused)} weights this engine's {cfg.model_type} has no "
                         f"place for, e.g. {unused[:3]}: a variant it does not implement")  # fmt: skip
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(state[name].shape)} != expected {tuple(tensor.shape)}"
            )
    model.load_state_dict({k: state[k].to(weight_dtype(cfg, k, dtype)) for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope()  # built on meta above; buffers are not in the file
    return model.to(device).eval().requires_grad_(False)


def save_model(
    model: LlamaForCausalLM, config: dict, out_dir: str | Path, *, dtype: torch.dtype = torch.float16
) -> None:
    """Write an HF-format directory: config.json, model.safetensors (in ``dtype``) and generation_config.json.
    ValueError for a Gemma model, whose norms hold ``1 + w`` where HF's hold ``w`` (spec_engine.models.gemma)."""
    if model.config.is_gemma:
        raise ValueError("save_model writes HF's layout; a Gemma model holds its norms folded (1 + w): not saved")
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
