"""The engine's GPU path, proven on a CPU machine: whole engine steps with every model tensor on the ``meta`` device.

Meta tensors stand in for CUDA ones: every op and view works on them, a CPU/meta mix raises ("Tensor on device cpu
is not on the expected device meta"), and any read of their data raises ("Cannot copy out of meta tensor"). So an
engine step whose weights and KV caches are on meta runs to its end exactly when it is device-true: every tensor it
computes is on the model's device, and nothing reads device data, except the one read the design allows per step
(``StepRunner._read_step``, the emitted tokens), which this test replaces by planted host values and counts.

Before the device-true engine, the first prefill failed here on a device mix in ``LlamaForCausalLM._rope``
(positions built on the CPU); with that fixed, each decode step read device data in the tree masks (one read per
tree level), in ``verify_tree``'s value checks and filter switch, and in the drafter's per-row draws and commit.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model, make_noisy_copy

from spec_engine import LLM, SamplingParams
from spec_engine.engine import Engine
from spec_engine.runner import StepRunner

V = 96


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta")
    from test_eagle import write_published_head

    return {
        "target": make_model(root / "target", "llama_gqa", layers=2),
        "draft": make_model(root / "draft", "llama_gqa", layers=1, seed=3),
        "head": write_published_head(root / "head", "eagle3"),
    }


class PlantedReads:
    """Stands in for the step's one device read: plants emitted tokens and accept counts, and counts the reads."""

    def __init__(self, max_path: int = 1):
        self.calls = 0
        self.max_path = max_path  # the deepest tree's nodes + 1: a path is at most that long

    def __call__(self, result, parents=None):
        assert result.output_tokens.device.type == "meta" and result.num_accepted.device.type == "meta"
        B, T = result.output_tokens.shape
        self.calls += 1
        num_accepted = [1 + (b + self.calls) % min(T, self.max_path) for b in range(B)]  # every path length
        tokens = [[(7 * b + 3 * i + self.calls) % V for i in range(T)] for b in range(B)]
        if parents is None:
            return tokens, num_accepted, [], []
        assert parents.device.type == "meta" and parents.shape == (B, T)
        chain = [-1, *range(T - 1)]  # (planted: the first T nodes as a chain, so any path of them is one)
        return tokens, num_accepted, [list(range(T))] * B, [chain] * B


SPECS = {
    "none": None,
    "chain": {"method": "draft_model", "num_speculative_tokens": 3},
    "tree": {"method": "draft_model", "num_speculative_tokens": 3, "tree": [2, 2, 1]},
    "tree_iid": {"method": "draft_model", "num_speculative_tokens": 2, "tree": [2, 2], "draft_sampling": "iid"},
    "deterministic": {"method": "draft_model", "num_speculative_tokens": 2, "draft_sampling": "deterministic"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "adaptive": {"method": "draft_model"},
    # EAGLE-2's dynamic trees, and the controller's width per step (a tree step's ranks ride on the one read)
    "eagle_dynamic": {"method": "eagle", "num_speculative_tokens": 3, "tree": "dynamic", "eagle_topk": 3},
    "eagle_auto": {"method": "eagle", "tree": "auto", "eagle_topk": 3},
}


@pytest.mark.parametrize("name", list(SPECS))
def test_engine_steps_are_device_true(models, name, monkeypatch):
    spec = SPECS[name]
    if spec is not None and spec["method"] in ("draft_model", "eagle"):
        spec = {**spec, "model": str(models["draft" if spec["method"] == "draft_model" else "head"])}
    llm = LLM(str(models["target"]), speculative_config=spec, device="meta", max_model_len=128, prefill_chunk=16)
    engine = llm.engine
    assert all(p.device.type == "meta" for p in llm.target.parameters()) and engine.kv.data.device.type == "meta"
    reads = PlantedReads(engine.gamma + 1)
    monkeypatch.setattr(StepRunner, "_read_step", staticmethod(reads))
    monkeypatch.setattr(Engine, "_fail", lambda self, req, error: (_ for _ in ()).throw(error))  # no isolation
    # a ragged batch: a prompt longer than the prefill chunk, short ones, one token; greedy and sampled rows with
    # every filter
    prompts = [list(range(1, 40)), [5, 6, 7, 5, 6, 7, 5, 6], [9], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=10, ignore_eos=True),
    ]
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    num_steps = decode_steps = 0
    while engine.has_unfinished():
        before = reads.calls
        decoding = sum(not r.prefilling for r in engine.running)
        engine.step()
        num_steps += 1
        assert reads.calls - before <= 1, "more than one device read in one step"
        decode_steps += reads.calls - before
        assert num_steps < 100
    assert all(r.finish_reason == "length" for r in reqs), [(r.finish_reason, r.error) for r in reqs]
    assert [len(r.output_token_ids) for r in reqs] == [p.max_tokens for p in params]
    assert decode_steps == reads.calls and decoding > 0
    assert llm.allocator.num_used == 0


def test_a_cpu_tensor_in_a_meta_step_is_caught(models, monkeypatch):
    """The simulation has teeth: a step input left on the host fails the run (here, the roots)."""
    llm = LLM(str(models["target"]), device="meta", max_model_len=64)
    monkeypatch.setattr(StepRunner, "_read_step", staticmethod(PlantedReads()))
    real = llm.engine.runner.step_inputs

    def roots_on_host(reqs, gammas, *rest):
        batch, sampling = real(reqs, gammas, *rest)
        batch.roots = torch.tensor([r.last_token for r in reqs])
        return batch, sampling

    monkeypatch.setattr(llm.engine.runner, "step_inputs", roots_on_host)
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    outs = llm.engine.step()  # prefill, then the decode step fails on the device mix and fails its request alone
    assert outs[0].request.finish_reason == "error" and "device" in outs[0].request.error


def test_a_device_read_in_a_meta_step_is_caught(models):
    """Without the planted read, the step's one read of device data is exactly where a meta run stops."""
    llm = LLM(str(models["target"]), device="meta", max_model_len=64)
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    outs = llm.engine.step()
    assert outs[0].request.finish_reason == "error" and "meta" in outs[0].request.error


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_DRAFTERS = ["chain", "tree", "ngram", "suffix", "hybrid", "eagle3", "eagle3_adaptive", "eagle3_dynamic",
                "eagle3_auto"]  # fmt: skip
PROCESSED = dict(logprobs=3, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, logit_bias={5: 2.0})
GPU_PARAMS = {  # each drafter's tokens must be plain decoding's on the same device, for each of these
    "greedy": SamplingParams(max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
    "processed": SamplingParams(max_tokens=24, ignore_eos=True, **PROCESSED),
}
GPU_PROMPTS = [{"prompt_token_ids": p} for p in ([5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2], [77])]


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    from test_eagle import write_published_head

    root = tmp_path_factory.mktemp("gpu")
    target = make_model(root / "target", "llama_gqa", logit_scale=4.0)
    return target, make_noisy_copy(target, root / "draft", noise=0.05), write_published_head(root / "head", "eagle3")


def gpu_spec(mode: str, draft, head) -> dict:
    return {
        "chain": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "tree": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "tree": [2, 2, 1]},
        "ngram": {"method": "ngram"},
        "suffix": {"method": "suffix"},
        "hybrid": {"method": "hybrid", "model": str(draft)},
        "eagle3": {"method": "eagle", "model": str(head), "num_speculative_tokens": 3},
        "eagle3_adaptive": {"method": "eagle", "model": str(head)},
        "eagle3_dynamic": {"method": "eagle", "model": str(head), "num_speculative_tokens": 3, "tree": "dynamic"},
        "eagle3_auto": {"method": "eagle", "model": str(head), "tree": "auto", "eagle_topk": 3},
    }[mode]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def gpu_plain(gpu_models, request):
    """Plain decoding on the GPU, per entry of GPU_PARAMS, in each dtype (bfloat16, CUDA's default, keeps greedy
    parity through the batch-invariant linear and tree attention kernels); returns (dtype, outputs by entry)."""
    llm = LLM(str(gpu_models[0]), device="cuda", dtype=request.param)
    return request.param, {
        name: llm.generate(GPU_PROMPTS, params, use_tqdm=False) for name, params in GPU_PARAMS.items()
    }


@pytest.mark.parametrize("mode", [pytest.param(m, marks=CUDA) for m in GPU_DRAFTERS])
def test_a_real_gpu_speculates_losslessly(gpu_models, gpu_plain, mode):
    """On a real GPU (bench/gpu.sh runs `pytest -m cuda`): every drafter emits plain decoding's tokens on the same
    device, greedy, seeded-sampled, and with logprobs and logits processors (penalties, a bias), whose rows take the
    regular step; their logprobs are plain decoding's."""
    dtype, plain = gpu_plain
    llm = LLM(str(gpu_models[0]), speculative_config=gpu_spec(mode, *gpu_models[1:]), device="cuda", dtype=dtype)
    assert llm.engine.kv.data.device.type == "cuda"
    for name, params in GPU_PARAMS.items():
        got = llm.generate(GPU_PROMPTS, params, use_tqdm=False)
        want = plain[name]
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], (mode, name)
        if params.logprobs:
            for g, w in zip(got, want):
                for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                    assert list(a) == list(b) and all(abs(a[i] - b[i]) < 1e-5 for i in a), (mode, a, b)
    if mode in ("chain", "tree", "eagle3"):
        assert llm.engine.stats["num_accepted"] > 0  # drafts were verified, not only plain steps


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_gpu_scores_as_the_cpu_does(gpu_models, gpu_plain):
    """The GPU's processed logprobs are the CPU's, on the tokens both emit (a near-tie may part them later)."""
    dtype, plain = gpu_plain
    if dtype != "float32":
        pytest.skip("the CPU's float32 logprobs are the reference for the GPU's float32 ones")
    want = LLM(str(gpu_models[0]), device="cpu", dtype="float32").generate(GPU_PROMPTS, GPU_PARAMS["processed"],
                                                                           use_tqdm=False)  # fmt: skip
    for g, w in zip(plain["processed"], want):
        common = 0
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            token = next(iter(a))
            if token != next(iter(b)):
                break
            common += 1
            assert abs(a[token] - b[token]) < 1e-3, (a, b)
        assert common >= 12, (g.outputs[0].token_ids, w.outputs[0].token_ids)
