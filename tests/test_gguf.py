"""GGUF checkpoints: tiny files written here in every supported type give the logits of the checkpoint they came
from (the K-quants, which gguf-py cannot quantize, as a file of random blocks that runs as stored exactly as
dequantized); config and tokenizer come from the metadata; unsupported files fail clearly. Real-model tests run on
SmolLM2-135M-Instruct when ``pull("smollm2")`` works (else they are skipped with one line saying why)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import gguf
import gguf_files
import numpy as np
import pytest
import torch
from gguf_files import chatml_tokenizer, dequantized, tokenizer_metadata, write_gguf
from safetensors.numpy import load_file
from test_quant_linear import random_blocks
from tiny_models import make_model

from spec_engine import LLM, SamplingParams
from spec_engine.models import ModelConfig, load_model
from spec_engine.models.gguf import (
    GGUF_ARCHITECTURES,
    SUPPORTED_TYPES,
    gguf_config,
    open_gguf,
    read_gguf_raw,
)
from spec_engine.models.gguf_tokenizer import gguf_tokenizer
from spec_engine.models.loader import build_model
from spec_kernels.decoder_layers.ref import LAYER_FIELDS
from spec_kernels.types import QUANT_FORMATS, QuantizedWeight, dequantize_ref

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# max |logit - the float32 checkpoint's| on the tiny model below (logits up to ~2.5; 4-bit blocks of N(0, 0.08)
# weights move them a lot), worst of 3 seeds: F16 2.8e-3, BF16 1.4e-2, Q8_0 5.9e-2, Q4_0 0.78, Q4_1 0.67, Q5_0 0.41,
# Q5_1 0.32; the bounds leave ~2x. The exact check is the other: the file's own dequantized weights give its logits
# bit for bit.
QUANT_LOGIT_TOL = {"F32": 0.0, "F16": 6e-3, "BF16": 3e-2, "Q8_0": 0.12, "Q4_0": 1.5, "Q4_1": 1.3, "Q5_0": 0.8,
                   "Q5_1": 0.65}  # fmt: skip

TEST_STRINGS = [
    "<|im_start|>user\nHi!<|im_end|>\n",
    "def f(x):\n    return x**2  # sq\n",
    "  spaces\t\ttabs\n\n\nend  ",
    "pi 3.14159, 2024 and ½ x²",
    "naïve café déjà vu, Ελληνικά",
    "日本語 中文 한국어 🙂🚀",
]
# SmolLM2's own tokenizer (HuggingFaceTB/SmolLM2-135M-Instruct tokenizer.json: Digits(individual) then ByteLevel)
SMOLLM2_IDS = [
    [1, 4093, 198, 26843, 17, 2, 198],
    [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 15375, 198],
    [216, 5600, 197, 197, 100, 7366, 1116, 198, 486, 256],
    [9020, 216, 35, 30, 33, 36, 33, 37, 41, 28, 216, 34, 32, 34, 36, 284, 216, 16738, 1792, 19133],
    [3546, 46494, 37366, 32564, 90, 16739, 386, 101, 28, 5664, 239, 17162, 17162, 25723, 11517, 12001, 21118, 26112],
    [23274, 115, 40993, 179, 120, 248, 216, 28589, 29184, 216, 33085, 246, 181, 130, 251, 183, 240, 129, 47526, 10813,
     244, 218],
]  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama_gqa", vocab_size=96, hidden=64, layers=2)


def _reference(hf_dir: Path, qtype: str):
    """Our model holding the checkpoint's weights as the file stores them, dequantized by gguf itself."""
    state = {n: torch.from_numpy(dequantized(w, qtype if w.ndim == 2 else "F32")) for n, w in
             load_file(str(hf_dir / "model.safetensors")).items()}  # fmt: skip
    return build_model(ModelConfig.from_dir(hf_dir), state, dtype=torch.float32, device="cpu", source=hf_dir)


@pytest.mark.parametrize("qtype", TYPES)
def test_logits_match_the_checkpoint(hf_dir, tmp_path, qtype):
    model = load_model(write_gguf(tmp_path / "m.gguf", hf_dir, qtype))
    ids = torch.randint(0, 96, (2, 11))
    got = model.forward_train(ids)  # [B, T, V]
    assert torch.equal(got, _reference(hf_dir, qtype).forward_train(ids))
    err = (got - load_model(hf_dir).forward_train(ids)).abs().max().item()
    assert err <= QUANT_LOGIT_TOL[qtype], f"{qtype}: {err}"


def test_config_from_metadata(hf_dir, tmp_path):
    got = asdict(gguf_config(open_gguf(write_gguf(tmp_path / "m.gguf", hf_dir))))
    want = asdict(ModelConfig.from_dir(hf_dir))
    want["rms_norm_eps"] = float(np.float32(want["rms_norm_eps"]))  # GGUF stores it as float32
    assert got == want


@pytest.mark.parametrize("arch,hf_arch", [("qwen2", "qwen2_tied"), ("qwen3", "qwen3")])
def test_qwen_architectures(tmp_path, arch, hf_arch):
    """Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (q/k norms, wider heads): no Q/K permutation in their files."""
    hf = make_model(tmp_path / "qwen", hf_arch, vocab_size=96, hidden=64, layers=2)
    model = load_model(write_gguf(tmp_path / "m.gguf", hf, "Q8_0", arch=arch))
    assert asdict(model.config) == {**asdict(ModelConfig.from_dir(hf)), "rms_norm_eps": model.config.rms_norm_eps}
    ids = torch.randint(0, 96, (1, 9))
    assert torch.equal(model.forward_train(ids), _reference(hf, "Q8_0").forward_train(ids))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_raw_blocks(hf_dir, tmp_path, qtype):
    """read_gguf_raw keeps quantized weights as their blocks, rows in HF's order (Q/K un-permuted)."""
    cfg, raw = read_gguf_raw(write_gguf(tmp_path / "m.gguf", hf_dir, qtype))
    weights = load_file(str(hf_dir / "model.safetensors"))
    q = raw["model.layers.1.self_attn.q_proj.weight"]
    n, k = weights["model.layers.1.self_attn.q_proj.weight"].shape
    per_block = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[qtype]
    assert (q.type_name, q.shape, q.data.dtype, tuple(q.data.shape)) == (qtype, (n, k), torch.uint8,
                                                                          (n, k // 32 * per_block))  # fmt: skip
    for name, r in raw.items():
        want = dequantized(weights[name], qtype if weights[name].ndim == 2 else "F32")
        assert np.array_equal(r.dequantize().numpy(), want), name
    assert raw["model.norm.weight"].type_name == "F32" and cfg.num_hidden_layers == 2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_dequantize_ref_is_gguf_bit_for_bit(qtype):
    w = (torch.randn(7, 96) * torch.logspace(-3, 1, 7)[:, None]).numpy()  # rows of very different scales
    t = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(w, t)
    assert np.array_equal(dequantize_ref(torch.from_numpy(blocks), qtype).numpy(), gguf.quants.dequantize(blocks, t))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "phi2.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"architecture 'phi2'.*llama"):
        load_model(path)
    assert "llama" in GGUF_ARCHITECTURES


def test_unsupported_tensor_type(hf_dir, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_dir, "Q8_0", type_of={"model.layers.0.mlp.up_proj.weight": "MXFP4"})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*MXFP4.*Q4_1.*Q6_K"):
        load_model(path)
    assert "MXFP4" not in SUPPORTED_TYPES and "Q4_K" in SUPPORTED_TYPES


# --- K-quants: a file of random blocks ----------------------------------------------------------------------------

# llama.cpp's _M mixes put most matrices in Q4_K (or Q5_0 where rows are not 256 wide) and some in Q6_K; this one
# holds every type the kernels read beyond the first three, including a q/k/v group of mixed types (q/k's blocks and
# v's apart) and same-type groups (fused blocks).
KQUANT_MIX = {
    "model.embed_tokens.weight": "Q4_K",
    "lm_head.weight": "Q6_K",
    "model.layers.0.self_attn.q_proj.weight": "Q4_K",
    "model.layers.0.self_attn.k_proj.weight": "Q4_K",
    "model.layers.0.self_attn.v_proj.weight": "Q6_K",
    "model.layers.0.self_attn.o_proj.weight": "Q5_K",
    "model.layers.0.mlp.gate_proj.weight": "Q3_K",
    "model.layers.0.mlp.up_proj.weight": "Q3_K",
    "model.layers.0.mlp.down_proj.weight": "Q2_K",
    "model.layers.1.self_attn.q_proj.weight": "Q5_0",
    "model.layers.1.self_attn.k_proj.weight": "Q5_0",
    "model.layers.1.self_attn.v_proj.weight": "Q5_0",
    "model.layers.1.self_attn.o_proj.weight": "Q5_1",
    "model.layers.1.mlp.gate_proj.weight": "Q4_K",
    "model.layers.1.mlp.up_proj.weight": "Q4_K",
    "model.layers.1.mlp.down_proj.weight": "Q6_K",
}
WEIGHT_STD = 0.08  # the tiny models' init (tiny_models.make_model)


def model_blocks(w: np.ndarray, qtype: str) -> np.ndarray:
    """Random blocks of ``w``'s shape in ``qtype`` (the values of ``w`` are not used), their fp16 scales set so the
    weights have about ``WEIGHT_STD``'s spread: every quant and sub-block scale random, as in test_quant_linear."""
    n, k = w.shape
    blocks = random_blocks(n, k, qtype, seed=n * 1000 + k)  # [N, row_bytes]
    per_block = blocks.view(-1, QUANT_FORMATS[qtype].block_bytes)
    ones = per_block.clone()
    for off in QUANT_FORMATS[qtype].fp16_offsets:
        ones[:, off : off + 2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    scale = WEIGHT_STD / dequantize_ref(ones.view(n, -1), qtype).std().item()
    for off in QUANT_FORMATS[qtype].fp16_offsets:
        value = per_block[:, off : off + 2].contiguous().view(torch.float16).float()
        spread = scale * (0.5 + value.abs() / (value.abs().max() + 1e-30) / 2) * value.sign()  # in [0.5, 1] x scale
        per_block[:, off : off + 2] = spread.half().view(torch.uint8)
    return blocks.numpy()


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory) -> Path:
    """A 256-wide Llama (rows of whole super-blocks) written as the K-quant mix, norms in F32."""
    d = tmp_path_factory.mktemp("kquant")
    hf = make_model(d / "hf", "llama_gqa", vocab_size=96, hidden=256, layers=2, logit_scale=4.0)
    original = gguf_files.stored

    def stored(w: np.ndarray, qtype: str):
        if qtype not in QUANT_FORMATS or qtype in ("Q8_0", "Q4_0", "Q4_1"):
            return original(w, qtype)
        return model_blocks(w, qtype), gguf.GGMLQuantizationType[qtype]

    gguf_files.stored = stored  # write_gguf's writer, with raw blocks where gguf-py has no quantizer
    try:
        return write_gguf(d / "mix.gguf", hf, "Q4_K", type_of=KQUANT_MIX)
    finally:
        gguf_files.stored = original


def test_kquant_blocks_read_as_stored(kquant_file):
    """read_gguf_raw keeps each tensor's type and bytes; their dequantization is gguf's, bit for bit."""
    reader = gguf.GGUFReader(str(kquant_file))
    stored = {t.name: t for t in reader.tensors}
    _, raw = read_gguf_raw(kquant_file)
    for name, qtype in KQUANT_MIX.items():
        r, t = raw[name], stored[gguf_files.gguf_name(name)]
        assert r.type_name == qtype == t.tensor_type.name, name
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(r.shape)
        got = r.dequantize().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # the loader un-permuted the rows: permute them back
            got = gguf_files.llama_cpp_permute(got, 4 if "q_proj" in name else 2)
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), name
        assert torch.isfinite(r.dequantize()).all() and 0.02 < float(r.dequantize().std()) < 0.3, name


def _greedy(llm: LLM, prompts: list, max_tokens: int = 20) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_kquant_file_runs_as_stored(kquant_file):
    """quantization="gguf" keeps the K-quant blocks and, in float32, gives the greedy tokens and logits of the same
    file dequantized at load, bit for bit (the kernel is linear on the dequantized weights)."""
    prompts = [{"prompt_token_ids": [5, 9, 13, 5, 9, 13, 5, 9]}, {"prompt_token_ids": [40, 41, 42, 7, 7, 7, 7]}]
    quant = LLM(str(kquant_file), dtype="float32", quantization="gguf", quant_activations="float")
    dense = LLM(str(kquant_file), dtype="float32")
    kept = {n: b.qtype for n, b in quant.target.quantized.items()}
    assert kept == KQUANT_MIX
    fields = quant.target.layer_weights
    v = LAYER_FIELDS.index("v")  # layer 0's q/k (Q4_K) and v (Q6_K) blocks apart, as stored
    assert (fields[1].qtype, fields[v].qtype) == ("Q4_K", "Q6_K") and fields[len(LAYER_FIELDS) + v] is None
    assert all(isinstance(w, QuantizedWeight) for w in fields[5:7])  # layer 0's gate_up (Q3_K), down (Q2_K)
    assert quant.engine.runner.native_target is not None  # the native steps run the blocks as stored
    tokens = _greedy(quant, prompts)
    assert tokens == _greedy(dense, prompts)
    assert len({t for row in tokens for t in row}) > 3  # not one token repeated: the check sees the weights
    ids = torch.tensor([[5, 9, 13, 5, 9, 13, 70, 2]])
    assert torch.equal(_prefill_logits(quant.target, ids), _prefill_logits(dense.target, ids))


def test_kquant_speculation_is_plain_decoding(kquant_file):
    """bfloat16 on the K-quant blocks: n-gram speculation emits plain decoding's tokens."""
    prompts = [{"prompt_token_ids": [5, 9, 13, 5, 9, 13, 5, 9, 13]}]
    plain = _greedy(LLM(str(kquant_file), dtype="bfloat16", quantization="gguf"), prompts, 32)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    spec = LLM(str(kquant_file), dtype="bfloat16", quantization="gguf", speculative_config=ngram)
    assert _greedy(spec, prompts, 32) == plain


def _prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits [T, V] of one causal prefill of ids [1, T] on an empty contiguous cache."""
    cfg, T = model.config, ids.shape[1]
    cache = torch.zeros(cfg.num_hidden_layers, 2, 1, T + 8, cfg.num_key_value_heads, cfg.head_dim,
                        dtype=model.model.norm.weight.dtype)  # fmt: skip
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]  # [1, T, T]
    hidden = model(ids, torch.arange(T)[None], cache, torch.zeros(1, dtype=torch.int32), mask)
    return model.logits(hidden)[0]


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not gguf at all")
    with pytest.raises(ValueError, match="GGUF"):
        load_model(path)


# --- the tokenizer -----------------------------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _bpe(pre: str):
    return chatml_tokenizer(SPECIALS, digits_apart=pre == "smollm")


@pytest.mark.parametrize("pre", ["smollm", "gpt-2"])
def test_tokenizer_equals_hf(hf_dir, tmp_path, pre):
    hf = _bpe(pre)
    meta = {**tokenizer_metadata(hf, SPECIALS, pre), "bos": 1, "eos": 2}
    ours = gguf_tokenizer(write_gguf(tmp_path / "t.gguf", hf_dir, tokenizer=meta))
    for s in TEST_STRINGS + ["12 345 6789", " ½ x² Ⅷ"]:
        ids = hf.encode(s).ids
        assert ours.encode(s).ids == ids, s
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_tokenizer_adds_bos_when_the_file_says_so(hf_dir, tmp_path):
    meta = {**tokenizer_metadata(_bpe("gpt-2"), SPECIALS), "bos": 1, "eos": 2, "add_bos": True}
    tok = gguf_tokenizer(write_gguf(tmp_path / "t.gguf", hf_dir, tokenizer=meta))
    assert tok.encode("hello").ids[0] == 1 and tok.encode("hello", add_special_tokens=False).ids[0] != 1


def test_metadata_it_needs_and_lacks_is_named(hf_dir, tmp_path):
    """A file without a key the model needs, or a BOS id outside its vocabulary, is a ValueError naming it."""
    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)  # (no head count, no embedding length)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="lacks llama.attention.head_count"):
        load_model(path)
    meta = {**tokenizer_metadata(_bpe("gpt-2"), SPECIALS), "bos": 10**6, "eos": 2, "add_bos": True}
    with pytest.raises(ValueError, match="bos_token_id 1000000 is not a token"):
        gguf_tokenizer(write_gguf(tmp_path / "t.gguf", hf_dir, tokenizer=meta))


def test_unsupported_pre_tokenizer(hf_dir, tmp_path):
    meta = tokenizer_metadata(_bpe("gpt-2"), SPECIALS, pre="deepseek-llm")
    with pytest.raises(ValueError, match="deepseek-llm.*smollm"):
        gguf_tokenizer(write_gguf(tmp_path / "t.gguf", hf_dir, tokenizer=meta))


# --- SmolLM2-135M-Instruct (pulled from the package registry) -----------------------------------------------------


def test_smollm2_tokenizer(smollm2):
    tok = gguf_tokenizer(smollm2)
    for s, ids in zip(TEST_STRINGS, SMOLLM2_IDS):
        assert tok.encode(s).ids == ids, s
        assert tok.decode(ids, skip_special_tokens=False) == s


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "def fib(n): complete this Python function",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer in one sentence.",
]


def test_smollm2_greedy_matches_transformers(smollm2):
    """Greedy tokens, float32, from the GGUF loaded directly: ours vs transformers' GGUF loader (dequantized).

    transformers checks our tokens teacher-forced, one forward per prompt: its argmax after every prefix of ours is
    our next token, so its own greedy decoding (stopping at EOS as we do) emits exactly our tokens. A position whose
    top-2 logits lie within 1e-3 is a coin toss between two float orders of summation: there our token need only be
    one of the tied pair (teacher forcing keeps every later position comparable)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    from spec_engine import LLM, SamplingParams

    llm = LLM(model=str(smollm2), dtype="float32", max_model_len=256)
    prompts = [llm.render_chat([{"role": "user", "content": c}])[1] for c in CHATS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0.0),
                        use_tqdm=False)  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32,
                                              quantization_config=GgufConfig(dequantize=True)).eval()  # fmt: skip
    same = num_ties = 0
    for prompt, out in zip(prompts, outs):
        ours = torch.tensor(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ours.tolist()])).logits[0, len(prompt) - 1 : -1]  # [n, V]
        top2 = logits.topk(2)
        tied = top2.values[:, 0] - top2.values[:, 1] < 1e-3  # [n]
        same += bool(torch.where(tied, (top2.indices == ours[:, None]).any(-1), top2.indices[:, 0] == ours).all())
        num_ties += int(tied.sum())
    assert same == len(CHATS)
    assert num_ties <= len(CHATS), "too many near-ties: the check would be vacuous"
