"""``quantization="gguf"``: a GGUF file's quantized matrices multiplied as stored (spec_kernels.quant_linear).

Exact checks on tiny files written here with gguf's writer: in float32 the quantized model's greedy tokens (and
logits) are those of the same file dequantized at load, since the kernel is ``linear`` on the dequantized weights bit
for bit; speculation on the quantized weights emits plain decoding's tokens. On SmolLM2-135M-Instruct (pulled from
the registry; skipped with one line when it is not available) the perplexity of a held-out text stays within 1% of
the dequantized model's in bfloat16.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf_files import write_gguf  # noqa: E402
from tiny_models import make_noisy_copy  # noqa: E402

from spec_engine import LLM, SamplingParams  # noqa: E402
from spec_engine.models import load_model  # noqa: E402
from spec_kernels.decoder_layers.ref import LAYER_FIELDS  # noqa: E402
from spec_kernels.types import QuantizedWeight  # noqa: E402

# (layer matrices' type, per-name overrides): SmolLM2's layout (Q4_1 layers, Q8_0 embedding, tied), each block
# type alone, and a q/k/v group of mixed types (q and k differ: dense q/k rows, v's blocks apart).
FILES = {
    "Q4_1": ("Q4_1", {"model.embed_tokens.weight": "Q8_0"}),
    "Q8_0": ("Q8_0", {}),
    "Q4_0": ("Q4_0", {}),
    "mixed": ("Q4_1", {"model.layers.0.self_attn.q_proj.weight": "Q8_0"}),
}
PROMPTS = [{"prompt_token_ids": [5, 9, 13, 5, 9, 13, 5, 9]}, {"prompt_token_ids": [40, 41, 42, 43, 7, 7, 7, 7, 7]}]


@pytest.fixture(scope="module")
def gguf_files(tied_llama_dir, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {name: write_gguf(d / f"{name}.gguf", tied_llama_dir, qtype, type_of=over)
            for name, (qtype, over) in FILES.items()}  # fmt: skip


def _tokens(llm: LLM, max_tokens: int = 24) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(FILES))
def test_float32_is_the_dequantized_model(gguf_files, name):
    """Same greedy tokens as the file dequantized at load, and the same logits bit for bit (float32)."""
    quant = LLM(str(gguf_files[name]), dtype="float32", quantization="gguf", quant_activations="float")
    dense = LLM(str(gguf_files[name]), dtype="float32")
    model = quant.target
    fields = model.layer_weights
    assert isinstance(fields[5], QuantizedWeight) and isinstance(fields[6], QuantizedWeight)  # gate_up, down
    assert isinstance(fields[1], torch.Tensor if name == "mixed" else QuantizedWeight)  # qkv (mixed: q/k dense)
    v = fields[LAYER_FIELDS.index("v")]  # v's rows apart where q/k/v's formats differ, still blocks
    assert v is None if name != "mixed" else v.qtype == "Q4_1"
    assert quant.engine.runner.native_target is not None  # the native chains run the blocks as stored
    assert _tokens(quant) == _tokens(dense)
    ids = torch.tensor([[5, 9, 13, 5, 9, 13, 70, 2]])
    assert torch.equal(_logits(model, ids), _logits(dense.target, ids))


def test_a_quantized_model_keeps_one_copy_of_its_blocks(gguf_files):
    """The fused q/k/v and gate/up blocks are the only copies: each projection's entry is a view of its rows (two
    copies had doubled an 8B file's resident memory), and rebuilding the native handle copies nothing. The file's
    pages are let go once read, and read back unchanged."""
    from spec_engine.models.gguf import open_gguf, read_gguf_raw

    model = load_model(gguf_files["Q8_0"], quantization="gguf")
    model.fuse(max_positions=64)
    qkv, gate_up = model.layer_weights[1], model.layer_weights[5]
    for fused, names in ((qkv, ("q", "k", "v")), (gate_up, ("gate", "up"))):
        for n in names:
            part = model.quantized[f"model.layers.0.{'self_attn' if n in 'qkv' else 'mlp'}.{n}_proj.weight"].data
            assert part.untyped_storage().data_ptr() == fused.data.untyped_storage().data_ptr()
    model.restrict_vocab(None)  # rebuilds the native handle
    assert model.layer_weights[1].data.untyped_storage().data_ptr() == qkv.data.untyped_storage().data_ptr()
    first = read_gguf_raw(gguf_files["Q8_0"])[1]  # (its pages released: open_gguf's parse stays cached)
    assert open_gguf(gguf_files["Q8_0"]).tensors
    again = read_gguf_raw(gguf_files["Q8_0"])[1]
    assert all(torch.equal(first[n].data, again[n].data) for n in first)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_is_plain_decoding(gguf_files, tied_llama_dir, tmp_path, dtype):
    """Lossless on the quantized weights: n-gram and draft-model speculation emit plain decoding's tokens."""
    path = str(gguf_files["Q4_1"])
    plain = _tokens(LLM(path, dtype=dtype, quantization="gguf"), 40)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert _tokens(LLM(path, dtype=dtype, quantization="gguf", speculative_config=ngram), 40) == plain
    draft = make_noisy_copy(tied_llama_dir, tmp_path / "draft", noise=0.3)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    assert _tokens(LLM(path, dtype=dtype, quantization="gguf", speculative_config=spec), 40) == plain


def test_errors(tied_llama_dir, gguf_files):
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(tied_llama_dir), quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be"):
        load_model(gguf_files["Q8_0"], quantization="awq")
    model = load_model(gguf_files["Q8_0"], quantization="gguf")
    with pytest.raises(NotImplementedError, match="quantization"):
        model.forward_train(torch.tensor([[1, 2, 3]]))


def test_the_default_numeric_mode_is_int8_where_a_vector_kernel_runs_it(gguf_files):
    """quant_activations=None: 8-bit activations where int8 blocks multiply with vector instructions (AVX2 and up),
    float where only the scalar kernel would (bench/RESULTS.md): in a process whose kernels are capped at AVX2
    (SPECDEC_CPU_ISA, as on a CPU without AVX-512) int8 too, where the CPU has AVX2 and F16C; at scalar, float."""
    import os
    import subprocess
    import sys

    from spec_engine.models.loader import default_quant_activations
    from spec_kernels.quant_linear import int8_path

    expected = "float" if int8_path() == "scalar" else "int8"
    assert default_quant_activations() == expected
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    narrowed = "SPECDEC_CPU_ISA" in os.environ or "SPECDEC_LINEAR_SCALAR" in os.environ
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"} <= flags and not narrowed:
        assert expected == "int8", f"a CPU with AVX512-VNNI multiplies int8 blocks on {int8_path()}"
    model = load_model(gguf_files["Q8_0"], quantization="gguf")
    assert {w.activations for w in model.quantized.values()} == {expected}
    code = "from spec_engine.models.loader import default_quant_activations as d; print(d())"
    for isa, want in (("avx2", "int8" if "f16c" in flags and "avx2" in flags else "float"), ("scalar", "float")):
        env = {k: v for k, v in os.environ.items() if k != "SPECDEC_LINEAR_SCALAR"} | {"SPECDEC_CPU_ISA": isa}
        capped = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert capped.stdout.split()[-1] == want, isa


def model_cache(model, length: int = 64) -> torch.Tensor:
    """A contiguous KV cache [layers, 2, 1, length, Hkv, D] in the model's dtype."""
    cfg = model.config
    shape = (cfg.num_hidden_layers, 2, 1, length, cfg.num_key_value_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=model.model.norm.weight.dtype)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits [T, V] of one causal prefill of ids [1, T] on an empty cache."""
    T = ids.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]  # [1, T, T]
    hidden = model(ids, torch.arange(T)[None], model_cache(model, T + 8), torch.zeros(1, dtype=torch.int32), mask)
    return model.logits(hidden)[0]


# --- SmolLM2-135M-Instruct ----------------------------------------------------------------------------------------


def test_smollm2_perplexity_within_one_percent(smollm2):
    """The blocks kept (8-bit activations where the CPU has them) against the dequantized model, over eval_int8's
    held-out text: its paragraph and the first 512 tokens of Python's textwrap.py. Over the paragraph alone the
    per-token differences' standard error was about the bound itself, so a change of summation order anywhere could
    carry the ratio past it (bench/RESULTS.md, "Attention's scores, keys in lanes")."""
    from bench.eval_int8 import held_out_ids
    from spec_engine.llm import load_tokenizer

    texts = held_out_ids(load_tokenizer(smollm2), window=512, windows=1)  # [1, T] each
    nll = {}
    for quantization in ("gguf", None):
        model = load_model(smollm2, dtype=torch.bfloat16, quantization=quantization).fuse()
        per_token = []
        for ids in texts:
            logits = _logits(model, ids)  # [T, V]
            per_token.append(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none"))
        nll[quantization] = torch.cat(per_token).mean().item()
    ratio = math.exp(nll["gguf"] - nll[None])  # perplexity over perplexity
    assert abs(ratio - 1) < 0.01, (ratio, nll)
