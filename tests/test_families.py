"""Model families against HF transformers, from HF directories and from GGUF files written here as llama.cpp's
converter writes them: float32 logits within a tight tolerance, greedy tokens equal to HF ``generate`` (stopping at
the first near-tie, as tests/test_engine_greedy.py does), and speculative greedy output equal to plain decoding's.

Each family is a small random-weight model built by transformers from a config given here (norm weights noised, so
that a norm's offset or fold is tested too)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from gguf_files import write_gguf
from tiny_models import hf_trusted_greedy, make_model, make_noisy_copy

from spec_engine import LLM, SamplingParams
from spec_engine.models import load_model
from spec_engine.step import REGULAR

# family -> (tiny_models arch, config overrides, the GGUF architecture llama.cpp's converter writes)
FAMILIES = {
    "llama": ("llama_gqa", {}, "llama"),
    "llama3": ("llama3_rope", {}, "llama"),
    "qwen2": ("qwen2_tied", {}, "qwen2"),  # q/k/v biases, tied embeddings
    "qwen3": ("qwen3", {}, "qwen3"),  # q/k norms
    "mistral": ("mistral", {"sliding_window": 256}, "llama"),  # (the window caps the context: 256 of 512 positions)
    "phi3": ("phi3", {"sliding_window": 300}, "phi3"),  # fused qkv_proj and gate_up_proj
    "gemma2": ("gemma2", {}, "gemma2"),  # [sliding, full] layers, a window of 8 positions, soft-capping
    "gemma3": ("gemma3", {"layers": 6}, "gemma3"),  # 5 sliding layers (local RoPE base), then a global one
}
# max |logit - HF's| in float32 (logits of a few units); measured ~1e-6, the bound leaves room for summation order
LOGIT_TOL = 1e-4
PROMPT = [5, 17, 3, 60, 42, 7, 5, 17, 3, 11, 2, 90]
MAX_TOKENS = 20


@functools.cache
def _family_dirs(family: str, root: Path) -> tuple[Path, Path, Path]:
    """(target HF directory, its GGUF file, a noisy copy to draft with)."""
    arch, over, gguf_arch = FAMILIES[family]
    target = make_model(root / family / "target", arch, logit_scale=4.0, norm_noise=0.2, **over)
    draft = make_noisy_copy(target, root / family / "draft", noise=0.1)
    return target, write_gguf(root / family / "target.gguf", target, "F32", arch=gguf_arch), draft


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return lambda family: _family_dirs(family, root)


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def engine_logits(model, ids: list[int], split: int) -> torch.Tensor:
    """Our logits [T, V] of ``ids`` through the engine's forward over a KV cache: a prefill of ``split`` tokens,
    then one token at a time (the decode path reads the prefix from the cache)."""
    cfg = model.config
    model.fuse(max_positions=64)
    kv = torch.zeros(cfg.num_hidden_layers, 2, 1, 64, cfg.num_key_value_heads, cfg.head_dim)
    tokens = torch.tensor([ids])  # [1, T]
    out = []
    for start, end in [(0, split), *((t, t + 1) for t in range(split, len(ids)))]:
        n = end - start
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]  # [1, n, n]
        hidden = model(tokens[:, start:end], torch.arange(start, end)[None], kv,
                       torch.tensor([start], dtype=torch.int32), mask)  # fmt: skip
        out.append(model.logits(hidden)[0])
    return torch.cat(out)  # [T, V]


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family_dirs, family, source):
    target, gguf_file, _ = family_dirs(family)
    with torch.no_grad():
        want = hf_model(target)(torch.tensor([PROMPT])).logits[0]  # [T, V]
        ours = load_model(target if source == "hf" else gguf_file, dtype=torch.float32)
        got = engine_logits(ours, PROMPT, split=7)
    err = (got - want).abs().max().item()
    assert err <= LOGIT_TOL, f"{family}/{source}: max |logit error| {err}"


@functools.cache
def hf_greedy(model_dir: Path, prompt: tuple[int, ...], n: int) -> tuple[list[int], int]:
    return hf_trusted_greedy(hf_model(model_dir), prompt, n)


SPECS = {"plain": None, "chain": {"method": "draft_model", "num_speculative_tokens": 3},
         "tree": {"method": "draft_model", "num_speculative_tokens": 2, "tree": [2, 2]}}  # fmt: skip


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers_and_speculation_matches_plain(family_dirs, family, source):
    target, gguf_file, draft = family_dirs(family)
    model = target if source == "hf" else gguf_file
    ref, trusted = hf_greedy(target, tuple(PROMPT), MAX_TOKENS)
    assert trusted > MAX_TOKENS // 2, "too many near-ties: the check would be vacuous"
    tokens, paths = {}, set()
    for name, spec in SPECS.items():
        spec = spec and dict(spec, model=str(draft))
        llm = LLM(str(model), speculative_config=spec, dtype="float32", max_model_len=128)
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)[0]
        tokens[name] = out.outputs[0].token_ids
        if spec is not None:
            assert out.metrics["num_accepted"] > 0, f"{family}/{name}: speculation accepted nothing"
        paths |= {(p.path, p.native_verify) for p in llm.engine.plan_history}
        assert llm.engine.runner.native_target is not None  # Gemma's with its variant (and Gemma 2's final cap)
    assert any(path != REGULAR or verify for path, verify in paths), paths  # the native paths ran
    assert tokens["plain"][: trusted - 1] == ref[: trusted - 1], f"{family}/{source}: diverges from HF greedy"
    assert tokens["chain"] == tokens["plain"] and tokens["tree"] == tokens["plain"]


def test_llama3_gguf_scales_the_frequencies_as_hf_and_the_native_path_reads_them(family_dirs):
    """The converter stores Llama 3's scaling as per-dimension divisors (rope_freqs.weight): they give HF's scaled
    frequencies, and the native C++ layers (which read RoPE from the model's cos/sin table) get that table."""
    from spec_engine.models import ModelConfig
    from spec_engine.models.config import FREQ_FACTORS, rope_inv_freq

    target, gguf_file, _ = family_dirs("llama3")
    ours, hf = load_model(gguf_file).config, ModelConfig.from_dir(target)
    assert ours.rope["rope_type"] == FREQ_FACTORS and hf.rope["rope_type"] == "llama3"
    want = rope_inv_freq(hf.rope, hf.head_dim)  # [D/2]
    assert not torch.equal(want, rope_inv_freq({**hf.rope, "rope_type": "default"}, hf.head_dim))  # scaling binds
    torch.testing.assert_close(rope_inv_freq(ours.rope, ours.head_dim), want, rtol=1e-6, atol=0)
    model = load_model(gguf_file).fuse(max_positions=64)
    assert model.native is not None and model.native.rope_table is model.rope_table


@pytest.mark.parametrize("family", ["phi3", "gemma2"])
def test_quantized_blocks_kept(family_dirs, tmp_path, family):
    """quantization="gguf" keeps the file's blocks: Phi-3's fused q/k/v and gate/up split by rows into the same
    blocks, the quantized model's logits the dequantized one's bit for bit (float32, the native layers: Gemma's with
    its variant); Gemma keeps its norms in float32, and its blocks beside them in bfloat16 still take the C++ op."""
    from spec_engine.models.gguf import read_gguf_raw
    from spec_kernels.types import QuantizedWeight

    target, _, _ = family_dirs(family)
    path = write_gguf(tmp_path / "q8.gguf", target, "Q8_0", arch=FAMILIES[family][2])
    cfg, raw = read_gguf_raw(path)
    q = raw["model.layers.0.self_attn.q_proj.weight"]
    assert q.type_name == "Q8_0" and q.shape == (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
    quant, dense = load_model(path, quantization="gguf", quant_activations="float"), load_model(path)
    quant.fuse(max_positions=64)
    assert isinstance(quant.layer_weights[1], QuantizedWeight) and isinstance(quant.layer_weights[5], QuantizedWeight)
    with torch.no_grad():
        got, want = engine_logits(quant, PROMPT, split=7), engine_logits(dense, PROMPT, split=7)
    assert torch.equal(got, want)
    if family == "gemma2":
        half = load_model(path, quantization="gguf", dtype=torch.bfloat16).fuse(max_positions=64)
        assert half.model.norm.weight.dtype == torch.float32 and half.lm_head.weight.dtype == torch.bfloat16
        assert half.layer_weights.takes(torch.bfloat16)


def _write_bare(path: Path, arch: str, extra_tensors=(), **meta) -> Path:
    """A GGUF file of architecture ``arch`` with a few hyper-parameters and an embedding (no layers)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in dict(block_count=1, embedding_length=32, feed_forward_length=64, head_count=4, **meta).items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for name in extra_tensors:
        w.add_tensor(name, np.ones(4, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_what_is_not_taken_is_named(tmp_path):
    """An architecture or model_type we do not take, and the Phi-3 variants we do not run, are ValueErrors that say
    so (and, for the families, what we take)."""
    from spec_engine.models import ModelConfig

    with pytest.raises(ValueError, match=r"architecture 'falcon'.*llama, qwen2, qwen3, phi3"):
        load_model(_write_bare(tmp_path / "falcon.gguf", "falcon"))
    with pytest.raises(ValueError, match="LongRoPE"):
        load_model(
            _write_bare(tmp_path / "long.gguf", "phi3", ["rope_factors_long.weight", "rope_factors_short.weight"])
        )
    with pytest.raises(ValueError, match="partial rotary"):
        load_model(_write_bare(tmp_path / "partial.gguf", "phi3", rope_dimension_count=4))
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"model_type='gpt_neox'.*llama, mistral, qwen2, qwen3, phi3"):
        ModelConfig.from_dict(dict(base, model_type="gpt_neox"))
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}
    with pytest.raises(ValueError, match="unsupported rope_type 'longrope'; supported: default, linear, llama3"):
        ModelConfig.from_dict(dict(base, model_type="phi3", rope_parameters=longrope))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        ModelConfig.from_dict(
            dict(base, model_type="phi3", rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5})
        )
    gemma = dict(base, model_type="gemma2", sliding_window=8)
    with pytest.raises(ValueError, match="hidden_act='silu' for gemma2"):
        ModelConfig.from_dict(dict(gemma, hidden_activation="silu"))
    with pytest.raises(ValueError, match="layer_types must list"):
        ModelConfig.from_dict(dict(gemma, layer_types=["full_attention", "global"]))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_dict(dict(gemma, model_type="gemma3_text", use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="gemma3 .image-text. config.json needs its text_config"):
        ModelConfig.from_dict(dict(gemma, model_type="gemma3"))
    from spec_engine.models.sharded import shard_plan

    with pytest.raises(ValueError, match="tensor_parallel_size > 1 runs llama, mistral, qwen2, qwen3.*'phi3'"):
        shard_plan(ModelConfig.from_dict(dict(base, model_type="phi3")), 2, 0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculation_equals_plain_decoding_in_bfloat16(family_dirs, family):
    """The engine's contract in a 16-bit dtype, where only batch-invariant kernels keep it (Gemma's regular steps run
    the C++ layers with its LayerVariant, batch-invariant as the Llama layer's)."""
    target, _, draft = family_dirs(family)
    prompts = [{"prompt_token_ids": p} for p in (PROMPT, [1, 2, 3, 4, 1, 2], [77])]
    specs = [None, {"method": "ngram", "num_speculative_tokens": 4}, *(dict(s, model=str(draft)) for s in
             (SPECS["chain"], SPECS["tree"]))]  # fmt: skip
    tokens = []
    for spec in specs:
        llm = LLM(str(target), speculative_config=spec, dtype="bfloat16", max_model_len=128)
        outs = llm.generate(prompts, SamplingParams(max_tokens=32), use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert all(t == tokens[0] for t in tokens[1:]), family


def test_gemma_holds_its_norms_folded_in_float32(family_dirs, tmp_path):
    """Gemma's norms hold 1 + w in float32, whatever the run dtype (HF adds the 1 in float32: the fold is exact),
    from an HF directory (folded at load) and a GGUF file (folded by the converter) alike; saving refuses."""
    from safetensors.torch import load_file

    from spec_engine.models import save_model

    target, gguf_file, _ = family_dirs("gemma3")
    w = load_file(str(target / "model.safetensors"))["model.layers.0.self_attn.q_norm.weight"]
    for source in (target, gguf_file):
        model = load_model(source, dtype=torch.bfloat16)
        held = model.model.layers[0].self_attn.q_norm.weight
        assert held.dtype == torch.float32 and torch.equal(held, w.float() + 1.0)
        assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="folded"):
        save_model(model, {}, tmp_path / "out")


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_steps_are_device_true(family_dirs, family, monkeypatch):
    """Gemma's Python steps on the simulated GPU (every model tensor on meta; see tests/test_simulated_cuda.py): a
    prefill and speculative tree steps run with the step's one device read and nothing on the host."""
    from test_simulated_cuda import PlantedReads

    from spec_engine.engine import Engine
    from spec_engine.runner import StepRunner

    target, _, draft = family_dirs(family)
    spec = dict(SPECS["tree"], model=str(draft))
    llm = LLM(str(target), speculative_config=spec, device="meta", max_model_len=64, prefill_chunk=8)
    reads = PlantedReads(llm.engine.gamma + 1)
    monkeypatch.setattr(StepRunner, "_read_step", staticmethod(reads))
    monkeypatch.setattr(Engine, "_fail", lambda self, req, error: (_ for _ in ()).throw(error))  # no isolation
    reqs = [llm.engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in (PROMPT, [3])]
    while llm.engine.has_unfinished():
        before = reads.calls
        llm.engine.step()
        assert reads.calls - before <= 1
    assert all(r.finish_reason == "length" for r in reqs) and reads.calls > 0


def test_gemma3_image_text_checkpoint_runs_its_text_model(tmp_path):
    """Gemma 3's image-text checkpoints (model_type gemma3, the text model under language_model.): our model is its
    text model, whose logits on a text prompt are HF's (the vision tower is not read)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=100, sliding_window=8, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    hf = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=99,
            boi_token_index=97,
            eoi_token_index=98,
        )
    )
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.dim() == 1 else 0.08)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.model_type == "gemma3_text" and ours.config.layer_types == text["layer_types"]
    with torch.no_grad():
        want = hf.eval()(torch.tensor([PROMPT])).logits[0]  # [T, V]
        got = engine_logits(ours, PROMPT, split=7)
    assert (got - want).abs().max().item() <= LOGIT_TOL
