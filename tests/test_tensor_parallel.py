"""Tensor parallelism (spec_engine/distributed/) on CPU: 2 ranks over gloo, tiny random HF checkpoints.

TP=2 runs the layer loop of torch ops with two all-reduces per layer; TP=1 runs the native one-call forward. The two
differ in summation order (the all-reduce adds two partial sums), so hidden states agree to ~1e-6, not bitwise; in
float32 that leaves every greedy and seeded token the same on these models, which is what the parity tests check.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_models import make_model, make_noisy_copy

from spec_engine import LLM, SamplingParams
from spec_engine.distributed.comm import pack_bits, unpack_bits
from spec_engine.models import load_model
from spec_engine.models.config import ModelConfig
from spec_engine.models.sharded import ShardedLlama, shard_plan

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}, {"prompt_token_ids": [40, 41, 42, 40, 41, 42, 40, 41, 9, 3]}]
MAX_TOKENS = 20
DEAD_WORKER_BOUND_S = 60  # a killed worker must fail the step well within this (measured: 6-65 ms)
HANG_GUARD_S = 600  # a subprocess that builds an LLM (maybe compiling the C++ extension first) gets this long


@pytest.fixture(autouse=True)
def _short_group_timeout(monkeypatch):
    monkeypatch.setenv("SPECDEC_TP_TIMEOUT_S", "30")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for arch in ("llama_gqa", "qwen2_tied", "llama3_rope"):  # GQA 4/2; Qwen2 q/k/v bias, tied; 1 KV head
        make_model(root / arch, arch, logit_scale=4.0)
        make_noisy_copy(root / arch, root / f"{arch}_draft", 0.3)
        out[arch] = (root / arch, root / f"{arch}_draft")
    return out


SPECS = {
    "none": lambda draft: None,
    "chain": lambda draft: {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
    "tree": lambda draft: {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "tree": [2, 2]},
    "ngram": lambda draft: {"method": "ngram", "num_speculative_tokens": 3},
}


def _generate(target, spec, tp: int, params: SamplingParams) -> list[list[int]]:
    llm = LLM(str(target), spec, dtype="float32", tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.close()


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_tied"])
def test_greedy_tp2_equals_tp1(models, arch, method):
    target, draft = models[arch]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    single = _generate(target, SPECS[method](draft), 1, params)
    assert _generate(target, SPECS[method](draft), 2, params) == single


def test_replicated_kv_head_tp2_equals_tp1(models):
    """One KV head, two ranks: both keep a copy of it (each rank's two query heads read it)."""
    target, draft = models["llama3_rope"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    assert _generate(target, SPECS["chain"](draft), 2, params) == _generate(target, None, 1, params)


@pytest.mark.parametrize("method", ["none", "chain"])
def test_seeded_sampling_tp2_equals_tp1(models, method):
    target, draft = models["llama_gqa"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=7)
    single = _generate(target, SPECS[method](draft), 1, params)
    assert _generate(target, SPECS[method](draft), 2, params) == single


def _workers(llm: LLM) -> list:
    return llm.target.processes


def test_killed_worker_fails_the_engine_fast(models):
    target, draft = models["llama_gqa"]
    llm = LLM(str(target), SPECS["chain"](draft), dtype="float32", tensor_parallel_size=2, max_model_len=128)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    try:
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert llm.healthy
        (worker,) = _workers(llm)
        steps = 0
        step = llm.engine.step

        def step_then_kill():  # the worker dies between two steps of a running generation
            nonlocal steps
            steps += 1
            if steps == 3:
                os.kill(worker.pid, signal.SIGKILL)
                worker.join(DEAD_WORKER_BOUND_S)
            return step()

        llm.engine.step = step_then_kill
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 died"):
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert time.monotonic() - start < DEAD_WORKER_BOUND_S
        assert not llm.healthy
        with pytest.raises(RuntimeError, match="rank 1 died"):  # and stays failed: no hang on a broken group
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
    finally:
        llm.close()


def test_worker_killed_mid_collective_raises(models):
    """The worker dies while rank 0 waits in a collective: gloo sees the connection close and rank 0 raises."""
    target, _ = models["llama_gqa"]
    llm = LLM(str(target), dtype="float32", tensor_parallel_size=2, max_model_len=128)
    try:
        (worker,) = _workers(llm)
        tp = llm.target
        forward = tp.shard.forward

        def forward_after_kill(*args):  # the command went out; the worker dies before the first all-reduce
            os.kill(worker.pid, signal.SIGKILL)
            return forward(*args)

        tp.shard.forward = forward_after_kill
        with pytest.raises(RuntimeError, match="TensorParallelError: tensor-parallel worker rank 1 died"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        assert not llm.healthy
    finally:
        llm.close()


def test_a_failure_on_rank_0_stops_the_workers_at_once(models):
    """Rank 0 raises inside a forward after the command went out: the worker waits in that forward's first
    all-reduce. The group is broken; rank 0 stops the worker at once (it sent it a SHUTDOWN, which the worker took
    for that all-reduce, and both waited out the group timeout: 120 s by default, the worker then exiting with 1)."""
    target, _ = models["llama_gqa"]
    llm = LLM(str(target), dtype="float32", tensor_parallel_size=2, max_model_len=128)
    try:
        (worker,) = _workers(llm)

        def broken_forward(*args):
            raise ValueError("a bug on rank 0")

        llm.target.shard.forward = broken_forward
        with pytest.raises(RuntimeError, match="a bug on rank 0"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        assert not llm.healthy and not worker.is_alive()
        assert worker.exitcode == -signal.SIGTERM  # stopped by rank 0, not by the group timeout
    finally:
        llm.close()


def test_health_turns_503_when_a_worker_dies(models):
    from fastapi.testclient import TestClient

    from spec_engine.server.app import create_app

    target, _ = models["llama_gqa"]
    llm = LLM(str(target), dtype="float32", tensor_parallel_size=2, max_model_len=128)
    try:
        with TestClient(create_app(llm, "tiny")) as client:
            assert client.get("/health").status_code == 200
            (worker,) = _workers(llm)
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(DEAD_WORKER_BOUND_S)
            assert client.get("/health").status_code == 503  # at once, with no step in between
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4})
            assert r.status_code >= 500
            assert client.get("/health").status_code == 503
    finally:
        llm.close()


def test_workers_exit_on_close_and_on_garbage_collection(models):
    target, _ = models["llama_gqa"]
    llm = LLM(str(target), dtype="float32", tensor_parallel_size=2, max_model_len=128)
    (worker,) = _workers(llm)
    hidden = torch.randn(3, llm.target.config.hidden_size)  # not from a forward: broadcast, then gathered
    torch.testing.assert_close(llm.target.logits(hidden), load_model(target).logits(hidden))
    llm.close()
    assert not worker.is_alive() and worker.exitcode == 0  # a clean SHUTDOWN, not a kill
    llm = LLM(str(target), dtype="float32", tensor_parallel_size=2, max_model_len=128)
    (worker,) = _workers(llm)
    del llm
    gc.collect()
    worker.join(DEAD_WORKER_BOUND_S)
    assert not worker.is_alive()


def test_a_forwards_hidden_states_stay_on_every_rank_after_other_logits(models):
    """``logits`` of the last forward's hidden states sends no rows (the workers kept theirs), also after the logits
    of other rows (broadcast to the workers): those must not replace the forward's there (they did: the workers then
    computed the other rows' logits, and the gather broke the group)."""
    from spec_engine.tree import causal_mask

    target, _ = models["llama_gqa"]
    llm = LLM(str(target), dtype="float32", tensor_parallel_size=2, max_model_len=128)
    try:
        tp, kv = llm.target, llm.engine.kv
        ids = torch.tensor([[5, 6, 7]])  # [1, 3]
        hidden = tp.forward(ids, torch.arange(3)[None], kv.data, torch.zeros(1, dtype=torch.int32),
                            causal_mask(1, 3), torch.tensor([[1]], dtype=torch.int32))  # fmt: skip
        full = load_model(target)
        expected = full.logits(hidden)
        torch.testing.assert_close(tp.logits(hidden), expected)
        other = torch.randn(2, tp.config.hidden_size)
        torch.testing.assert_close(tp.logits(other), full.logits(other))
        torch.testing.assert_close(tp.logits(hidden), expected)
    finally:
        llm.close()


def test_no_orphans_when_the_parent_is_killed(models, tmp_path):
    """A parent killed with SIGKILL runs no cleanup at all; its workers notice and exit by themselves."""
    target, _ = models["llama_gqa"]
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys, time
        from spec_engine import LLM
        if __name__ == "__main__":
            llm = LLM({str(target)!r}, dtype="float32", tensor_parallel_size=2, max_model_len=128)
            print(*[p.pid for p in llm.target.processes], flush=True)
            time.sleep(600)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], HANG_GUARD_S)  # a stuck parent fails, never hangs
        assert ready, "the parent never built its LLM"
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 1
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + DEAD_WORKER_BOUND_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_torchrun_launch_equals_tp1(models, tmp_path):
    """``torchrun --nproc-per-node 2 script.py``: both ranks build the same LLM; rank 1 serves inside ``LLM(...)``
    and exits with it, rank 0 generates."""
    import socket

    target, _ = models["llama_gqa"]
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(f"""
        from spec_engine import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({str(target)!r}, dtype="float32", tensor_parallel_size=2, max_model_len=128)
            out = llm.generate({PROMPTS!r}, SamplingParams(max_tokens={MAX_TOKENS}), use_tqdm=False)
            print("TOKENS", [o.outputs[0].token_ids for o in out], flush=True)
            llm.close()
    """)
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(port), str(script)], capture_output=True, text=True,
                         env=env, timeout=HANG_GUARD_S)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("TOKENS")]  # rank 0 only
    assert line == f"TOKENS {_generate(target, None, 1, SamplingParams(max_tokens=MAX_TOKENS))}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited (its reaper is gone with the parent)
    except FileNotFoundError:
        return False


def test_bad_sizes_raise_clear_errors(models):
    target, _ = models["llama_gqa"]  # 4 query heads, 2 KV heads, intermediate 128
    cfg = ModelConfig.from_dir(target)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        shard_plan(cfg, 3, 0)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        LLM(str(target), dtype="float32", tensor_parallel_size=3)  # before any worker starts
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="positive int"):
            LLM(str(target), dtype="float32", tensor_parallel_size=bad)
    few_kv = ModelConfig.from_dict({**_cfg_dict(cfg), "num_attention_heads": 12, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="not a multiple of the 4 KV heads"):
        shard_plan(few_kv, 6, 0)
    odd_kv = ModelConfig.from_dict({**_cfg_dict(cfg), "num_attention_heads": 12, "num_key_value_heads": 6})
    with pytest.raises(ValueError, match="does not divide the 6 KV heads"):
        shard_plan(odd_kv, 4, 0)
    with pytest.raises(ValueError, match="intermediate_size"):
        shard_plan(ModelConfig.from_dict({**_cfg_dict(cfg), "intermediate_size": 130}), 4, 0)
    with pytest.raises(ValueError, match="EAGLE"):
        LLM(str(target), {"method": "eagle", "model": str(target)}, dtype="float32", tensor_parallel_size=2)
    from spec_engine.distributed import launch

    with pytest.raises(ValueError, match="rank r uses cuda:r"):  # (cuda:1 would put rank 0 and rank 1 on one GPU)
        launch(target, 2, dtype=torch.float32, device="cuda:1")


def _cfg_dict(cfg: ModelConfig) -> dict:
    return {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads}  # fmt: skip


def test_shard_plan_splits_and_replicates():
    base = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1}  # fmt: skip
    cfg = ModelConfig.from_dict({**base, "num_attention_heads": 8, "num_key_value_heads": 2})
    plans = [shard_plan(cfg, 4, r) for r in range(4)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # query heads 0-3 read KV head 0
    assert [p.vocab for p in plans] == [(0, 25), (25, 50), (50, 75), (75, 97)] and plans[0].vocab_per_rank == 25
    assert [p.intermediate for p in plans] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    split = shard_plan(cfg, 2, 1)
    assert (split.q_heads, split.kv_heads) == ((4, 8), (1, 2))


def test_shard_reads_its_slices_of_the_checkpoint(models):
    """Rank 1 of 2's tensors are exactly its rows / columns of the full model's (Qwen2: biases too)."""
    target, _ = models["qwen2_tied"]
    full = load_model(target).fuse()
    cfg = full.config
    plan = shard_plan(cfg, 2, 1)
    shard = ShardedLlama(target, cfg, plan, None, torch.float32, torch.device("cpu"))
    D, H = cfg.head_dim, cfg.hidden_size
    attn, mlp = full.model.layers[0].self_attn, full.model.layers[0].mlp
    q, kv = slice(plan.q_heads[0] * D, plan.q_heads[1] * D), slice(plan.kv_heads[0] * D, plan.kv_heads[1] * D)
    inter = slice(*plan.intermediate)
    _, qkv, bias, o, _, gate_up, down, *_ = shard.weights[:9]
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight[q], attn.k_proj.weight[kv], attn.v_proj.weight[kv]]))
    assert torch.equal(bias, torch.cat([attn.q_proj.bias[q], attn.k_proj.bias[kv], attn.v_proj.bias[kv]]))
    assert torch.equal(o, attn.o_proj.weight[:, q]) and torch.equal(down, mlp.down_proj.weight[:, inter])
    assert torch.equal(gate_up, torch.cat([mlp.gate_proj.weight[inter], mlp.up_proj.weight[inter]]))
    rows = full.model.embed_tokens.weight[plan.vocab[0] : plan.vocab[1]]
    assert shard.embed.shape == (plan.vocab_per_rank, H) and torch.equal(shard.embed[: rows.shape[0]], rows)
    assert shard.lm_head is shard.embed  # tied


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 5), (3, 16, 16), (1, 64, 64)])
def test_tree_mask_bits_round_trip(shape):
    mask = torch.rand(shape) < 0.5
    assert torch.equal(unpack_bits(pack_bits(mask), shape), mask)


def test_cli_generate_tensor_parallel(models, tmp_path, capsys):
    """``--tensor-parallel-size 2 --compare``: two groups side by side (speculative and plain), the same tokens."""
    from tiny_models import make_tokenizer

    from spec_engine.cli import main

    target, draft = models["llama_gqa"]
    assert main(["generate", "--prompt", "x", "--model", str(target), "--tensor-parallel-size", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err
    tok = make_tokenizer(tmp_path / "m")
    make_model(tmp_path / "m", "llama_gqa", vocab_size=tok.get_vocab_size(), logit_scale=4.0)
    argv = ["generate", "--prompt", "def fib(n):", "--model", str(tmp_path / "m"), "--method", "ngram", "-k", "3",
            "--max-tokens", "16", "--dtype", "float32", "--tensor-parallel-size", "2", "--compare",
            "--compare-repeats", "1"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("x | same tokens")
    gc.collect()  # the two LLMs' workers stop with them
