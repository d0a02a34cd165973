"""The LLM API: bad input gets a clear error and leaves the engine usable; stops, limits and metrics."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import make_model, make_noisy_copy

from spec_engine import LLM, SamplingParams
from spec_engine.llm import auto_dtype

PROMPT = {"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    target = make_model(root / "target", "llama_gqa", logit_scale=4.0)
    draft = make_noisy_copy(target, root / "draft", noise=0.3)
    other_vocab = make_model(root / "other", "llama_gqa", vocab_size=50)
    return target, draft, other_vocab


@pytest.fixture(scope="module")
def llm(dirs):
    target, draft, _ = dirs
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    return LLM(str(target), speculative_config=spec, max_model_len=64)


def greedy(llm, max_tokens=16, **kw):
    return llm.generate(PROMPT, SamplingParams(max_tokens=max_tokens, **kw), use_tqdm=False)[0]


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ({"prompt_token_ids": []}, SamplingParams(max_tokens=8), "empty"),
        ({"prompt_token_ids": [1, 96]}, SamplingParams(max_tokens=8), r"\[0, 96\)"),
        ({"prompt_token_ids": [-1]}, SamplingParams(max_tokens=8), r"\[0, 96\)"),
        ({"prompt_token_ids": list(range(60))}, SamplingParams(max_tokens=8), "max_model_len"),
        ({"prompt_token_ids": [1] * 80}, SamplingParams(max_tokens=1), "max_model_len"),
        ("text", SamplingParams(max_tokens=8), "tokenizer"),
        (42, SamplingParams(max_tokens=8), "prompt must be"),
    ],
)
def test_bad_prompts_raise_and_the_engine_survives(llm, prompt, params, match):
    before = greedy(llm).outputs[0].token_ids
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert llm.allocator.num_used == 0 and not llm.engine.has_unfinished()
    assert greedy(llm).outputs[0].token_ids == before


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(seed="x"), "seed"),
        (dict(ignore_eos="no"), "ignore_eos"),
    ],
)
def test_invalid_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_top_k_minus_one_is_off_as_in_vllm():
    """vLLM's documented "-1 considers all tokens" (the server takes it too) is top-k off, not a ValueError."""
    assert SamplingParams(top_k=-1, temperature=1.0).top_k == 0


def test_vocab_mismatch_is_refused_at_load(dirs):
    target, _, other = dirs
    with pytest.raises(ValueError, match="vocab"):
        LLM(str(target), speculative_config={"method": "draft_model", "model": str(other)})


def test_a_draft_with_other_token_texts_is_refused_at_load(dirs, tmp_path):
    """Two tokenizers of the same size (Llama 2's and Mistral's both hold 32000 tokens) whose ids name other texts:
    the draft's ids would mean other tokens to the target (lossless, but nearly never accepted). Refused, naming
    the first id that differs, for HF directories and GGUF files alike; the same tokenizer in either form loads."""
    from gguf_files import tokenizer_metadata, write_gguf
    from tiny_models import CORPUS, make_tokenizer

    target, draft = (shutil.copytree(d, tmp_path / d.name) for d in dirs[:2])  # (the module's dirs have none)
    same = make_tokenizer(target, 300)
    other = make_tokenizer(tmp_path / "other_tok", 300, corpus=[t[::-1] for t in CORPUS])
    assert other.get_vocab_size() == same.get_vocab_size()
    meta = lambda tok: {**tokenizer_metadata(tok, []), "bos": 0, "eos": 1}  # noqa: E731
    files = {name: write_gguf(tmp_path / f"{name}.gguf", draft, tokenizer=meta(tok))
             for name, tok in (("same", same), ("other", other))}  # fmt: skip
    (draft / "tokenizer.json").write_text((tmp_path / "other_tok" / "tokenizer.json").read_text())
    for d in (draft, files["other"]):
        with pytest.raises(ValueError, match=r"draft's tokenizer .* differs from the target's .*: token \d+ is"):
            LLM(str(target), speculative_config={"method": "draft_model", "model": str(d)}, max_model_len=64)
    target_file = write_gguf(tmp_path / "target.gguf", target, tokenizer=meta(same))
    with pytest.raises(ValueError, match="differs from the target's"):
        LLM(str(target_file), speculative_config={"method": "draft_model", "model": str(draft)}, max_model_len=64)
    (draft / "tokenizer.json").write_text((target / "tokenizer.json").read_text())
    for t, d in ((target, files["same"]), (target_file, draft), (target_file, files["same"])):
        LLM(str(t), speculative_config={"method": "draft_model", "model": str(d)}, max_model_len=64)


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"method": "eagle"}, "method"),
        ({"method": "draft_model"}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "tree": [2]}, "tree"),
        ({"method": "ngram", "bogus": 1}, "unknown"),
        ({"method": "ngram", "max_n": "3"}, "max_n"),
        ({"method": "ngram", "max_n": 2.5}, "max_n"),
        ({"method": "ngram", "min_n": 0}, "min_n"),
        ({"method": "ngram", "max_n": 2, "min_n": 3}, "exceeds max_n"),
        ({"method": "suffix", "max_n": 3}, "method='ngram'"),
        ({"method": "suffix", "model": "x"}, "model needs a drafter with weights"),
        ({"method": "ngram", "draft_sampling": "iid"}, "draft_sampling needs a drafter with weights"),
        ({"method": "draft_model", "model": "x", "eagle_topk": 3}, "needs tree='dynamic'"),
        ({"method": "draft_model", "model": "x", "tree": [True, 2]}, "list of positive ints"),
    ],
)
def test_bad_speculative_config(dirs, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(dirs[0]), speculative_config=spec)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(prefill_chunk=0), "prefill_chunk"),
        (dict(prefill_chunk=-1), "prefill_chunk"),
        (dict(block_size=0), "block_size"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=-5), "max_model_len"),
        (dict(max_model_len="100"), "max_model_len"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
        (dict(tensor_parallel_size=True), "tensor_parallel_size"),
        (dict(device="tpu"), "device"),
    ],
)
def test_bad_engine_sizes_are_refused_before_loading(dirs, kw, match):
    """Sizes that would hang the engine (no request admitted, a prefill that never advances) or fail every request."""
    with pytest.raises(ValueError, match=match):
        LLM(str(dirs[0]), **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")
def test_an_indexed_cuda_device_without_cuda_is_refused(dirs):
    """device="cuda:0" is a CUDA device as "cuda" is: a clear ValueError without one (was an AssertionError from
    deep in the loader)."""
    with pytest.raises(ValueError, match="no CUDA device"):
        LLM(str(dirs[0]), device="cuda:0")


def test_missing_and_corrupt_checkpoints(dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        LLM(str(bad))
    (bad / "config.json").write_text((dirs[0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(bad))
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt"):
        LLM(str(bad))
    cfg = json.loads((dirs[0] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        LLM(str(bad))


def test_max_tokens_is_exact_even_when_a_step_emits_several(llm):
    for n in (1, 2, 3, 7):
        assert len(greedy(llm, max_tokens=n).outputs[0].token_ids) == n


def test_stop_token_ends_the_request(llm):
    full = greedy(llm, max_tokens=16).outputs[0].token_ids
    stop = full[5]
    out = greedy(llm, max_tokens=16, stop_token_ids=[stop])
    first = full.index(stop)
    assert out.outputs[0].token_ids == full[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert greedy(llm, max_tokens=16).outputs[0].finish_reason == "length"


def test_metrics(llm):
    out = greedy(llm, max_tokens=16)
    m = out.metrics
    assert m["num_steps"] == sum(m["accepted_length_hist"])
    assert m["num_accepted"] == sum(k * c for k, c in enumerate(m["accepted_length_hist"]))
    assert 0 <= m["acceptance_rate"] <= 1 and m["mean_accepted_length"] >= 1
    assert m["tokens_per_s"] > 0
    # generation alone excludes the prompt's processing: a higher rate, over less than the whole request's time
    assert m["decode_tokens_per_s"] > m["tokens_per_s"] and 16 / m["decode_tokens_per_s"] < m["elapsed"]
    one = llm.generate([{"prompt_token_ids": [3]}], SamplingParams(max_tokens=4), use_tqdm=False)[0].metrics
    assert one["decode_tokens_per_s"] > 0  # a one-token prompt has no prefill: its generation starts decoding


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
@pytest.mark.parametrize("max_num_seqs,max_model_len", [(1, 47), (1, 64), (3, 33)])
def test_default_kv_budget_fits_max_num_seqs_full_requests(dirs, spec, max_num_seqs, max_model_len):
    """The default KV budget holds max_num_seqs full-length requests at once, for any block alignment."""
    llm = LLM(str(dirs[0]), speculative_config=spec, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              block_size=16)  # fmt: skip
    engine = llm.engine
    assert engine.allocator.num_blocks - 1 >= max_num_seqs * engine.allocator.blocks_for(
        max_model_len + engine.max_tree_nodes()
    )
    prompts = [{"prompt_token_ids": [1 + b] * 4} for b in range(max_num_seqs)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_model_len - 4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [max_model_len - 4] * max_num_seqs
    assert engine.allocator.num_used == 0


def test_auto_dtype_is_the_fastest_for_the_device(dirs, monkeypatch):
    """dtype="auto" (the default) is bfloat16 on CPUs whose flags give the native bf16 kernels their vector path,
    float32 elsewhere (and on meta); $SPECDEC_AUTO_DTYPE overrides it (conftest sets float32); the LLM reports what it
    chose, and greedy speculation stays exact in it."""
    from spec_kernels._backend import cpu_supports_native_bf16

    assert auto_dtype("cpu") == auto_dtype("meta") == "float32"  # the session's $SPECDEC_AUTO_DTYPE
    monkeypatch.setenv("SPECDEC_AUTO_DTYPE", "float16")
    assert auto_dtype("cpu") == "float16"
    monkeypatch.setenv("SPECDEC_AUTO_DTYPE", "int8")
    with pytest.raises(ValueError, match="SPECDEC_AUTO_DTYPE must be one of"):
        auto_dtype("cpu")
    monkeypatch.delenv("SPECDEC_AUTO_DTYPE")
    assert auto_dtype("cpu") == ("bfloat16" if cpu_supports_native_bf16() else "float32")
    assert auto_dtype("meta") == "float32"
    target, draft, _ = map(str, dirs)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    plain, fast = LLM(target, dtype="bfloat16"), LLM(target, spec, dtype="bfloat16")
    assert plain.dtype == "bfloat16" and plain.target.lm_head.weight.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [5, 9, 4, 4, 7]}]
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)
    ]
    with pytest.raises(ValueError, match="'auto' or one of"):
        LLM(target, dtype="float64")
