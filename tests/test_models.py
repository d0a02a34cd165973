"""Tests of spec_engine.models: config parsing and its errors, RoPE variants, the HF directory round trip, and the
fused weights (views of one matrix, not copies)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_engine.models import LlamaForCausalLM, ModelConfig, load_model, save_model
from spec_engine.models.config import rope_inv_freq
from spec_kernels.decoder_layers.ref import LAYER_FIELDS


def hf_config(**overrides) -> dict:
    cfg = dict(model_type="llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
               num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
               rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", eos_token_id=2,
               bos_token_id=1)  # fmt: skip
    cfg.update(overrides)
    return cfg


def random_model(cfg: dict, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_dict(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


# --- config ---------------------------------------------------------------------------------------------------


def test_config_defaults_and_spellings():
    cfg = ModelConfig.from_dict(hf_config(num_key_value_heads=None, eos_token_id=2))
    assert cfg.num_key_value_heads == 6 and cfg.head_dim == 8  # MHA; hidden / heads
    assert cfg.eos_token_id == [2] and not cfg.attention_bias and not cfg.qk_norm
    assert ModelConfig.from_dict(hf_config(eos_token_id=[2, 5])).eos_token_id == [2, 5]
    assert ModelConfig.from_dict(hf_config(eos_token_id=None)).eos_token_id == []
    assert ModelConfig.from_dict(hf_config(head_dim=16)).head_dim == 16  # an explicit head_dim wins (Qwen3)
    assert ModelConfig.from_dict(hf_config(model_type="qwen2")).attention_bias
    assert ModelConfig.from_dict(hf_config(model_type="qwen3")).qk_norm


def test_a_sliding_window_caps_the_context(caplog):
    """Windowed attention is not implemented: a window shorter than the context caps it, and a warning says so."""
    with caplog.at_level("WARNING", logger="spec_engine.models"):
        cfg = ModelConfig.from_dict(hf_config(model_type="mistral", sliding_window=128))
    assert cfg.max_position_embeddings == cfg.sliding_window == 128
    assert "window of 128 positions) is not implemented; the context is capped to 128" in caplog.text
    assert ModelConfig.from_dict(hf_config(model_type="mistral", sliding_window=None)).max_position_embeddings == 256
    off = ModelConfig.from_dict(hf_config(model_type="qwen2", sliding_window=128, use_sliding_window=False))
    assert off.max_position_embeddings == 256


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"model_type": "gpt2"}, "unsupported architecture"),
        ({"model_type": None}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act='gelu' for llama; SwiGLU"),
        ({"num_key_value_heads": 4}, "multiple of num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs a positive low_freq_factor"),
        ({"hidden_size": None}, "lacks 'hidden_size'"),
        ({"hidden_size": "320"}, "hidden_size must be a positive integer"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
        ({"eos_token_id": "2"}, "eos_token_id must be"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_config_errors(overrides, match):
    cfg = {k: v for k, v in hf_config(**overrides).items() if v is not None or k not in overrides}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(cfg)


def test_generation_config_adds_its_stop_tokens(tmp_path):
    """A chat model's end-of-turn token named in generation_config.json only (as HF's generate reads it) stops
    generation too; a config.json that is not an object is a ValueError naming the file."""
    (tmp_path / "config.json").write_text(json.dumps(hf_config(eos_token_id=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_id == [2, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "9"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="config.json.*must hold a JSON object"):
        ModelConfig.from_dir(tmp_path)


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        ModelConfig.from_dir(tmp_path)


# --- RoPE -----------------------------------------------------------------------------------------------------


def test_rope_spellings_agree():
    """transformers 5's ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling`` ("type") parse alike."""
    new = ModelConfig.from_dict(hf_config(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}))
    old = ModelConfig.from_dict(hf_config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    assert new.rope["rope_type"] == old.rope["rope_type"] == "linear"
    assert torch.equal(rope_inv_freq(new.rope, 64), rope_inv_freq(old.rope, 64))
    assert ModelConfig.from_dict(hf_config()).rope == {"rope_type": "default", "rope_theta": 10000.0}


def test_rope_default_and_linear():
    D, theta = 64, 1e5  # SmolLM2's
    expected = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # [D/2]
    default = rope_inv_freq({"rope_type": "default", "rope_theta": theta}, D)
    assert default.shape == (D // 2,) and torch.equal(default, expected)
    linear = rope_inv_freq({"rope_type": "linear", "rope_theta": theta, "factor": 4.0}, D)
    assert torch.equal(linear, expected / 4.0)


def test_rope_llama3_keeps_high_frequencies_and_scales_low_ones():
    D = 128
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # Llama-3.1's  # fmt: skip
    base = rope_inv_freq({"rope_type": "default", "rope_theta": 5e5}, D)
    got = rope_inv_freq(rope, D)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4.0  # short wavelengths: unchanged
    low = wavelen > 8192 / 1.0  # long ones: divided by the factor
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(got[high], base[high])
    assert torch.allclose(got[low], base[low] / 8.0)
    mid = ~high & ~low  # smoothly in between
    assert bool(((got[mid] < base[mid]) & (got[mid] > base[mid] / 8.0)).all())


# --- load / save ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip(tmp_path, tied):
    cfg = hf_config(tie_word_embeddings=tied)
    model = random_model(cfg)
    save_model(model, cfg, tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert set(loaded.state_dict()) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, cfg["vocab_size"], (2, 11))  # [B, T]
    with torch.no_grad():
        assert torch.equal(loaded.forward_train(ids), model.forward_train(ids))  # [B, T, V]
    half = load_model(tmp_path, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16 and not half.lm_head.weight.requires_grad


def test_load_errors(tmp_path):
    cfg = hf_config()
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path)
    save_model(random_model(cfg), cfg, tmp_path, dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(num_hidden_layers=3)))
    with pytest.raises(ValueError, match="lacks 9 weights"):  # a third layer's nine tensors
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(intermediate_size=96)))
    with pytest.raises(ValueError, match="checkpoint shape"):
        load_model(tmp_path)
    model = random_model(hf_config(model_type="qwen2"))  # (q/k/v biases)
    save_model(model, hf_config(), tmp_path, dtype=torch.float32)
    extra = load_file(str(tmp_path / "model.safetensors")) | {"model.layers.0.self_attn.o_proj.bias": torch.ones(48)}
    save_file(extra, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(attention_bias=True)))
    with pytest.raises(ValueError, match="has no place for.*o_proj.bias"):  # not silently dropped
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="corrupt weight file"):
        load_model(tmp_path)


# --- fuse -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_fused_weights_are_views_of_one_matrix(model_type):
    cfg = hf_config(model_type=model_type)
    model = random_model(cfg)
    ids = torch.randint(0, cfg["vocab_size"], (1, 9))
    with torch.no_grad():
        before = model.forward_train(ids)
        names = set(model.state_dict())
        model.fuse(max_positions=32)
        assert torch.equal(model.forward_train(ids), before)  # the same numbers under the same names
    assert set(model.state_dict()) == names
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert attn.qkv_weight.shape == (6 * 8 + 2 * 2 * 8, 48)  # [(Hq + 2 Hkv) D, hidden]
    for part in (q, k, v):
        assert part.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    with torch.no_grad():
        attn.qkv_weight[6 * 8] = 7.0  # k's first row
    assert bool((k[0] == 7.0).all())
    assert mlp.gate_up_weight.shape == (2 * 80, 48)
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
    assert (attn.qkv_bias is not None) == (model_type == "qwen2")
    if attn.qkv_bias is not None:
        assert attn.v_proj.bias.untyped_storage().data_ptr() == attn.qkv_bias.untyped_storage().data_ptr()
    assert model.rope_table.shape == (2, 32, 8)  # [cos/sin, positions, D]
    assert len(model.layer_weights) == 2 * len(LAYER_FIELDS)


# --- the target interface -------------------------------------------------------------------------------------


def test_both_targets_implement_the_target_interface():
    """The engine reads a target through ``Target`` only: the one-process model and the tensor-parallel rank 0 both
    provide it; the native handle exists once fused with a RoPE table (CPU, float32 here), never before."""
    from spec_engine.distributed import TPTarget
    from spec_engine.models import Target

    model = random_model(hf_config())
    assert isinstance(model, Target) and model.native is None
    assert model.fuse(max_positions=32).native is not None
    members = {"native", "fuse", "__call__", "forward_features", "logits"}  # (config is set per instance)
    assert all(hasattr(TPTarget, m) for m in members) and TPTarget.native is None
