"""The captured target forward (spec_engine/cuda_graphs.py), proven on the CPU: bucket choice, padding, the copies
into the static inputs, padding rows that write the scratch block only, and steps whose tokens, logits and caches are
the eager path's bitwise. ``ReplayGraph`` stands in for ``torch.cuda.CUDAGraph`` (a replay runs the captured
function again on the same static tensors); the meta engine runs the captured path up to its one host read; dynamo
finds no graph break in the captured function (nor in the verify and compaction after it, given device seeds)."""

from __future__ import annotations

import pytest
import torch
from test_simulated_cuda import PlantedReads
from tiny_models import make_model, make_noisy_copy

from spec_engine import LLM, SamplingParams, cuda_graphs
from spec_engine.cuda_graphs import BATCH_BUCKETS, CapturedForward, ReplayGraph, batch_bucket, captured_forward
from spec_engine.engine import Engine, EngineConfig
from spec_engine.kv_cache import SCRATCH_BLOCK
from spec_engine.runner import StepRunner
from spec_engine.threads import ThreadTuner
from spec_kernels import compact_kv_, verify_tree

# the regular (Python-driven) step on the CPU: the native multi-step calls and tree_step off
REGULAR = dict(plain_chain=1, spec_chain_steps=0, native_tree_step=False)
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2], [77])]
# rows finish at different steps: the batch shrinks (4-row bucket, then 2, then 1) and stale rows become padding
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 13, 7)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from test_eagle import write_published_head

    root = tmp_path_factory.mktemp("graphs")
    target = make_model(root / "target", "llama_gqa", logit_scale=4.0)
    heads = {layout: write_published_head(root / layout, layout) for layout in ("eagle3", "eagle")}
    return target, make_noisy_copy(target, root / "draft", noise=0.05), heads


def spec_of(name: str, draft, heads) -> dict | None:
    return {
        "none": None,
        "chain": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "tree": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "tree": [2, 2, 1]},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3},  # (fixed: "auto" prices steps by their time)
        "eagle3": {"method": "eagle", "model": str(heads["eagle3"]), "num_speculative_tokens": 3},
        # a head's static tree: its nodes' forwards read their parents' outputs (node_graphs), on the CPU too
        "eagle3_tree": {"method": "eagle", "model": str(heads["eagle3"]), "num_speculative_tokens": 2, "tree": [2, 2]},
        # an EAGLE-1 head has no native path: its catch-ups read the feature cache in Python (graphs)
        "eagle1": {"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 3},
    }[name]


def test_batch_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 8, 9, 17, 256)] == [1, 2, 4, 8, 8, 16, 24, 256]
    assert batch_bucket(257) is None and list(BATCH_BUCKETS) == sorted(set(BATCH_BUCKETS))
    graphs = CapturedForward(None, "cpu", table_width=4, max_rows=16, max_width=5, graph=ReplayGraph, max_graphs=2)
    assert graphs.max_tokens == 16 * 5
    assert graphs.bucket(3, 5) == (4, 5) and graphs.bucket(16, 5) == (16, 5) and graphs.bucket(1, 6) is None
    graphs.buckets = {(1, 1): None, (4, 5): None}  # the cap: a new shape runs eagerly, captured ones still replay
    assert graphs.bucket(2, 1) is None and graphs.bucket(3, 5) == (4, 5)


def test_captured_forward_is_cpu_free_unless_named():
    assert captured_forward(None, torch.device("cpu"), table_width=4, max_rows=4, max_width=1) is None
    assert captured_forward(None, torch.device("meta"), table_width=4, max_rows=4, max_width=1) is None
    with pytest.raises(ValueError, match="unknown graph mechanism"):
        captured_forward(None, torch.device("cpu"), table_width=4, max_rows=4, max_width=1, mechanism="nope")


def test_padding_rows_see_length_zero_and_scratch_blocks():
    """A step of 3 rows after one of 4 in the same bucket, its block table narrower: row 3 (the earlier step's real
    row) becomes padding, length 0 and every block the scratch block, and the earlier table's wider columns scratch,
    so no K/V can land in a request's blocks; then a wider step again."""
    seen = []

    def forward(tokens, positions, cache_seqlens, tree_mask, block_table):  # records what the captured function reads
        seen.append((tokens.clone(), cache_seqlens.clone(), block_table.clone()))
        B, T = tokens.shape
        return (tokens[..., None] * 1.0 + positions[..., None]).expand(B, T, 3).float(), None

    graphs = CapturedForward(forward, "cpu", table_width=6, max_rows=4, max_width=2, graph=ReplayGraph)

    def step(B, W):
        tokens = torch.arange(B * 2).view(B, 2) + 10
        positions = torch.arange(B)[:, None] * 5 + torch.arange(2)
        cache_seqlens = torch.arange(B, dtype=torch.int32) * 5 + 1
        table = torch.arange(B * W, dtype=torch.int32).view(B, W) + 1  # W of the 6 columns; ids 1.. (0: scratch)
        logits, features = graphs(tokens, positions, cache_seqlens, torch.ones(B, 2, 2, dtype=torch.bool).tril(), table)
        assert features is None and logits.shape == (B, 2, 3)
        assert torch.equal(logits, forward(tokens, positions, cache_seqlens, None, table)[0])  # (records one more)
        return table

    step(4, 4)
    table = step(3, 2)
    assert list(graphs.buckets) == [(4, 2)] and graphs.num_replays == 2
    tokens, cache_seqlens, block_table = seen[-2]  # the second replay's inputs
    assert cache_seqlens.tolist() == [1, 6, 11, 0]
    assert torch.equal(block_table[:3, :2], table) and (block_table[:3, 2:] == SCRATCH_BLOCK).all()
    assert (block_table[3:] == SCRATCH_BLOCK).all()
    table = step(4, 5)
    block_table = seen[-2][2]
    assert torch.equal(block_table[:, :5], table) and (block_table[:, 5:] == SCRATCH_BLOCK).all()
    assert seen[0][1].tolist() == [0, 0, 0, 0] and (seen[0][2] == SCRATCH_BLOCK).all()  # the warm-up: padding only


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SEEDED = [SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True) for n in (20, 13, 7)]


def test_a_failed_capture_turns_graphs_off(caplog):
    """A capture that raises (e.g. a host read under SPECDEC_DEBUG_CHECKS=1) is logged once; that step and every
    later one run eagerly, with the eager result."""

    class Refuses(ReplayGraph):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    def forward(tokens, positions, cache_seqlens, tree_mask, block_table):
        return tokens[..., None].float(), None

    graphs = CapturedForward(forward, "cpu", table_width=2, max_rows=2, max_width=1, graph=Refuses)
    inputs = (torch.tensor([[4]]), torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
              torch.ones(1, 1, 1, dtype=torch.bool), torch.ones(1, 1, dtype=torch.int32))  # fmt: skip
    assert graphs(*inputs)[0].tolist() == [[[4.0]]] and graphs.disabled and not graphs.buckets
    assert graphs.bucket(1, 1) is None and "runs eagerly from now on" in caplog.text


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["none", "chain", "tree", "ngram", "eagle3", "eagle3_tree", "eagle1"])
def test_captured_steps_equal_eager_steps(models, name, dtype, where, monkeypatch):
    """Replayed buckets (the target's pass, a draft model's forwards) give the eager path's tokens and caches bitwise
    (the scratch block aside), greedy and seeded, in both dtypes: the forward is batch-invariant, so padded buckets
    and the full-width block table change no real row. On CUDA (bench/gpu.sh runs ``pytest -m cuda``) with real CUDA
    graphs; on the CPU with the stand-in. Every decode step on the caller's threads: the thread tuner's choice follows
    the machine's load, and the EAGLE-1 head's torch ops round differently on one thread (its cache then differed
    on a busy machine)."""
    monkeypatch.setattr(ThreadTuner, "single_for_step", lambda self: False)
    spec = spec_of(name, *models[1:])
    runs = []
    for eager in (True, False):
        mechanism = None if eager or where == "cuda" else "replay"
        config = EngineConfig(**REGULAR, enforce_eager=eager, graph_mechanism=mechanism)
        llm = LLM(str(models[0]), speculative_config=spec, device=where, dtype=dtype, engine_config=config,
                  max_model_len=128)  # fmt: skip
        outs = [
            o.outputs[0].token_ids for params in (PARAMS, SEEDED) for o in llm.generate(PROMPTS, params, use_tqdm=False)
        ]
        caches = [llm.engine.kv.data[:, :, SCRATCH_BLOCK + 1 :].clone()]  # [layers, 2, blocks - 1, ...]
        drafter = llm.engine.drafter
        if drafter is not None and drafter.keeps_cache:
            caches.append(drafter.kv.data[:, :, SCRATCH_BLOCK + 1 :].clone())
        if drafter is not None and drafter.needs_hidden:
            caches.append(drafter.features[:, SCRATCH_BLOCK + 1 :].clone())  # [1, blocks - 1, block_size, H]
        drafted = [getattr(drafter, name, None) for name in ("graphs", "node_graphs")]
        runs.append((outs, caches, llm.engine.runner.graphs, drafted))
    (want, want_caches, none, _), (got, got_caches, graphs, (draft_graphs, node_graphs)) = runs
    assert none is None and graphs.num_replays > 0 and any(rows == 4 for rows, _ in graphs.buckets)  # 3 rows: 4
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
    if name in ("chain", "tree", "eagle3"):
        assert any(width > 1 for _, width in graphs.buckets)  # verified trees replayed too
    if name in ("chain", "tree", "eagle1"):  # the drafter's forwards (catch-ups, a tree's levels) replayed too
        assert draft_graphs.num_replays > 0 and (name != "tree" or any(w > 1 for _, w in draft_graphs.buckets))
    if name in ("eagle3_tree", "eagle1"):  # a head's nodes on their parents' outputs
        assert node_graphs.num_replays > 0


def test_enforce_eager_changes_nothing_on_cpu(models):
    assert LLM(str(models[0]), max_model_len=64).engine.runner.graphs is None  # CPU: no mechanism, no graphs
    llm = LLM(
        str(models[0]), max_model_len=64, enforce_eager=True, engine_config=EngineConfig(graph_mechanism="replay")
    )
    assert llm.engine.config.enforce_eager and llm.engine.runner.graphs is None
    llm.engine.reconfigure(EngineConfig(**REGULAR, graph_mechanism="replay"))
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    llm.engine.reconfigure(EngineConfig(**REGULAR, graph_mechanism="replay", unsure_chain_steps=2))
    assert llm.engine.runner.graphs is graphs  # the same choice keeps the buckets captured so far
    llm.target.capturable = False  # (a tensor-parallel target: each call broadcasts its inputs from the host)
    llm.engine.reconfigure(EngineConfig(**REGULAR, graph_mechanism="replay"))
    assert llm.engine.runner.graphs is None


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_startup_captures_the_common_buckets(models, device):
    """Built with graphs on, the engine captures the target's buckets for batch 1, 2 and 4 (max_num_seqs 3) at the
    plain width and each tree width the controller can choose, before any request; on the CPU the first steps then
    replay them and capture nothing."""
    spec = spec_of("chain", *models[1:])  # depth 3: verify widths 4, 3, 2 and a plain step's 1
    config = EngineConfig(**REGULAR, graph_mechanism="replay")
    llm = LLM(str(models[0]), speculative_config=spec, device=device, max_model_len=128, max_num_seqs=3,
              engine_config=config)  # fmt: skip
    graphs = llm.engine.runner.graphs
    assert llm.engine.verify_widths() == (1, 4, 3, 2)
    assert list(graphs.buckets) == [(rows, w) for rows in (1, 2, 4) for w in (1, 4, 3, 2)]
    assert graphs.num_replays == 0 and all(rows * w <= graphs.max_tokens for rows, w in graphs.buckets)
    llm.engine.reconfigure(config)  # the same choice: nothing captured again
    assert llm.engine.runner.graphs is graphs and len(graphs.buckets) == 12
    if device == "cpu":
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert graphs.num_replays > 0 and len(graphs.buckets) == 12


def test_startup_captures_are_capped(models, monkeypatch):
    """At most MAX_STARTUP_GRAPHS buckets at start-up, batch 1 first; plain decoding has the one width."""
    monkeypatch.setattr(cuda_graphs, "MAX_STARTUP_GRAPHS", 3)
    llm = LLM(str(models[0]), max_model_len=64, max_num_seqs=64, engine_config=EngineConfig(**REGULAR,
              graph_mechanism="replay"))  # fmt: skip
    assert llm.engine.verify_widths() == (1,) and list(llm.engine.runner.graphs.buckets) == [(1, 1), (2, 1), (4, 1)]
    config = EngineConfig(graph_mechanism="replay")
    llm = LLM(str(models[0]), max_model_len=64, enforce_eager=True, engine_config=config)
    assert llm.engine.runner.graphs is None  # eager: nothing captured


@pytest.mark.parametrize("name", ["none", "tree", "ngram"])
def test_meta_engine_runs_the_captured_path(models, name, monkeypatch):
    """The captured path is device-true: on meta (our simulated GPU) whole engine steps replay buckets, copying their
    inputs into the static tensors, with one host read per step (planted)."""
    spec = spec_of(name, *models[1:])
    llm = LLM(str(models[0]), speculative_config=spec, device="meta", max_model_len=128, prefill_chunk=16,
              engine_config=EngineConfig(graph_mechanism="replay"))  # fmt: skip
    engine = llm.engine
    reads = PlantedReads(engine.gamma + 1)
    monkeypatch.setattr(StepRunner, "_read_step", staticmethod(reads))
    monkeypatch.setattr(Engine, "_fail", lambda self, req, error: (_ for _ in ()).throw(error))
    for prompt, params in zip(PROMPTS, PARAMS):
        engine.add_request(prompt["prompt_token_ids"], params)
    steps = 0
    while engine.has_unfinished() and steps < 100:
        before = reads.calls
        engine.step()
        assert reads.calls - before <= 1
        steps += 1
    graphs = engine.runner.graphs
    assert not engine.has_unfinished() and graphs.num_replays == reads.calls > 0
    assert graphs.outputs[0].device.type == "meta"


def _bucket_inputs(llm: LLM, rows: int, width: int):
    """A bucket's static inputs on the model's device, as ``CapturedForward`` makes them."""
    width_w = llm.engine.rows.block_table.shape[1]
    graphs = captured_forward(llm.engine.runner.target_logits, llm.engine.device, mechanism="replay",
                              table_width=width_w, max_rows=rows, max_width=width)  # fmt: skip
    bucket = graphs._capture(rows, width)
    return graphs, (bucket.tokens, bucket.positions, bucket.cache_seqlens, bucket.tree_mask, bucket.block_table)


@pytest.mark.parametrize(("device", "name"), [("cpu", "none"), ("cpu", "eagle3"), ("meta", "none")])
def test_the_captured_function_has_no_graph_break(models, device, name):
    """What a bucket captures, traced by dynamo: one graph, no break (a break is Python between ops, which a replay
    would skip). On meta it is the CUDA path (torch ops around the Triton kernels), on CPU the native one (with an
    EAGLE-3 head, its features too; a head does not build on meta)."""
    llm = LLM(str(models[0]), speculative_config=spec_of(name, *models[1:]), device=device, max_model_len=64)
    graphs, inputs = _bucket_inputs(llm, 2, 3)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(graphs.forward)(*inputs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_the_verify_and_compaction_after_it_have_no_graph_break(models):
    """The rest of a speculative step on the device path (meta): the pass, ``verify_tree`` with per-row device seeds
    and the cache's compaction trace as one graph, so a later capture can take the whole step. (Given no seeds,
    verify_tree draws one on the host: a break.)"""
    llm = LLM(str(models[0]), device="meta", max_model_len=64)
    graphs, inputs = _bucket_inputs(llm, 2, 3)
    tokens, _, cache_seqlens, _, table = inputs
    parents = torch.tensor([-1, 0, 1], device="meta").repeat(2, 1)
    planes = llm.engine.kv.planes

    def step(*inputs):
        logits, _ = graphs.forward(*inputs)
        B = logits.shape[0]
        zeros = torch.zeros(B, device=logits.device)
        result = verify_tree(logits, tokens, parents, temperature=zeros, seed=torch.zeros_like(tokens[:, 0]))
        compact_kv_(planes, cache_seqlens, result.accepted_nodes, result.num_accepted, block_table=table)
        return result.output_tokens, result.num_accepted, zeros

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(*inputs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_the_traced_forward_gives_the_eager_logits(models):
    """``torch.compile(fullgraph=True)`` of the captured function on the CPU, through AOT autograd's functional graph
    (inductor's own compile takes half a minute here: bench/gpu_decode.py times it on the device), gives the eager
    logits and writes the same cache; the custom ops' fake kernels carry it."""
    llm = LLM(str(models[0]), max_model_len=64)
    graphs, inputs = _bucket_inputs(llm, 2, 3)
    tokens, positions, cache_seqlens, mask, table = inputs
    tokens.copy_(torch.tensor([[5, 17, 3], [1, 2, 3]]))
    table[:, 0] = torch.tensor([1, 2])  # (rows that share the scratch block race on its slots: padding rows do)
    kv = llm.engine.kv.data
    kv.zero_()  # (the capture's warm-up wrote the scratch block)
    want, _ = graphs.forward(*inputs)
    cache = kv.clone()
    kv.zero_()
    torch._dynamo.reset()
    got, _ = torch.compile(graphs.forward, fullgraph=True, dynamic=False, backend="aot_eager")(*inputs)
    assert torch.equal(got, want) and torch.equal(kv, cache)
