"""The GPU's decode figures, most valuable first, within one deadline (bench/gpu.sh runs it first):

    python bench/gpu_decode.py [--model DIR_OR_GGUF] [--out DIR] [--deadline-s 330] [--dry-run]

1. ``decode``: plain decoding, batch 1, SmolLM2-135M's shape (``--model``, else random weights of its shape written
   here: a call cannot carry its 270 MB), tok/s eager with the unfused elementwise ops (``SPECDEC_FUSED_ELEMENTWISE=0``:
   the torch ops), eager with the fused kernels (``spec_kernels.fused_elementwise``) and the captured forward (CUDA
   graphs, fused), bf16 and fp32, interleaved rounds; the same tokens eager and captured.
2. ``parity``: bf16 greedy speculative output against plain decoding's, 5 requests: on the SmolLM2-shaped model with
   the shipped EAGLE-3 head at depth 3 and n-gram chains (verify widths 4 and 5), and on the embedded pair with its
   draft model (drafts that are accepted, so paths are compacted).
3. ``launches``: ATen ops, host launch calls and kernels per plain and speculative step, eager (unfused and fused)
   and captured (bench/count_launches.py).
4. ``speedup``: the embedded pair in bf16, the captured path: plain, draft model and hybrid (the default) tok/s and
   their ratios, plus plain eager (the old path), interleaved rounds.
5. ``mechanisms``: where time remains, the other graph mechanisms (``spec_engine.cuda_graphs.MECHANISMS``: inductor
   fusion under a manual capture, ``torch.compile(mode="reduce-overhead")``) on SmolLM2-shaped plain decoding, bf16.

Each section is skipped once the deadline is near, and a failing one is logged and the next runs. Writes
``gpu_decode.json`` under ``--out`` and prints one summary line per row last. Exits 1 on a failed section or a
parity row whose tokens differ. ``--dry-run`` runs every section on the CPU with tiny models and the "replay"
stand-in for graphs (the script's own check; tests/test_gpu_decode.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.count_launches import count_step_ops  # noqa: E402
from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402
from spec_engine.engine import EngineConfig  # noqa: E402
from spec_engine.zoo import MODELS_DIR  # noqa: E402

# SmolLM2-135M-Instruct's config (its GGUF's): what the random-weight stand-in copies
SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
TINY = {**SMOLLM2, "vocab_size": 512, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
# the regular (Python-driven) step everywhere: what CUDA runs, and on a CPU (--dry-run) the same path
REGULAR = dict(plain_chain=1, spec_chain_steps=0, native_tree_step=False)
TEXT_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "def is_palindrome(s):", "for i in range(10):"]


def random_model(path: Path, config: dict, seed: int = 0) -> Path:
    """An HF directory with ``config``'s shape and random bf16 weights (no tokenizer: prompts are token ids)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    H, inter, D = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * D, config["num_key_value_heads"] * D
    g = torch.Generator().manual_seed(seed)

    def w(*shape):  # std 0.05: logits far from flat, so greedy text is not one token repeated
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(config["vocab_size"], H), "model.norm.weight": torch.ones(H).bfloat16()}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(H).bfloat16(),
            p + "post_attention_layernorm.weight": torch.ones(H).bfloat16(),
            p + "self_attn.q_proj.weight": w(q, H), p + "self_attn.k_proj.weight": w(kv, H),
            p + "self_attn.v_proj.weight": w(kv, H), p + "self_attn.o_proj.weight": w(H, q),
            p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
            p + "mlp.down_proj.weight": w(H, inter),
        }  # fmt: skip
    save_file(tensors, str(path / "model.safetensors"))
    return path


class Bench:
    """The run's settings, its deadline and what it found (``rows``, ``failures``)."""

    def __init__(self, args: argparse.Namespace, model: str):
        self.args, self.model = args, model
        self.device = "cpu" if args.dry_run else "cuda"
        self.mechanism = "replay" if args.dry_run else None  # None: CUDA graphs
        self.tokens = 12 if args.dry_run else 128
        self.rounds = 1 if args.dry_run else 3
        self.start = time.perf_counter()
        self.rows: list[dict] = []
        self.failures: list[str] = []
        vocab = (TINY if args.dry_run else SMOLLM2)["vocab_size"]
        g = torch.Generator().manual_seed(1)
        self.id_prompts = [{"prompt_token_ids": torch.randint(3, vocab, (24,), generator=g).tolist()} for _ in range(5)]

    def left(self) -> float:
        return self.args.deadline_s - (time.perf_counter() - self.start)

    def llm(self, model: str, dtype: str, graphs: bool | str = True, spec: dict | None = None,
            max_num_seqs: int = 8) -> LLM:  # fmt: skip
        """``graphs``: True (the default mechanism), False (eager) or a mechanism's name. Batch-1 sections pass
        ``max_num_seqs=1``: one start-up bucket per width (a compiled mechanism compiles each)."""
        mechanism = graphs if isinstance(graphs, str) else self.mechanism
        config = EngineConfig(**REGULAR, enforce_eager=graphs is False, graph_mechanism=None if graphs is False
                              else mechanism)  # fmt: skip
        return LLM(model, speculative_config=spec, device=self.device, dtype=dtype, engine_config=config,
                   max_model_len=1024, max_num_seqs=max_num_seqs)  # fmt: skip

    def section(self, name: str, need_s: float, fn) -> None:
        """Run ``fn`` if ``need_s`` seconds remain; log and count a failure, then go on."""
        if self.left() < need_s:
            print(f"== {name}: skipped ({self.left():.0f} s left, needs ~{need_s:.0f})", flush=True)
            self.rows.append({"section": name, "skipped": True})
            return
        print(f"== {name} ({self.left():.0f} s left)", flush=True)
        began = time.perf_counter()
        try:
            fn()
        except Exception:  # a section's failure is reported; the others still run
            traceback.print_exc()
            self.failures.append(name)
        print(f"== {name}: {time.perf_counter() - began:.1f} s", flush=True)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print("   " + " | ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              flush=True)  # fmt: skip


def _tps(llm: LLM, prompts, params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Decode tok/s (generation only, summed over the requests one at a time) and the tokens."""
    tokens, seconds = [], 0.0
    for p in prompts:
        out = llm.generate([p], params, use_tqdm=False)[0]
        tokens.append(out.outputs[0].token_ids)
        seconds += len(tokens[-1]) / max(out.metrics["decode_tokens_per_s"], 1e-9)
    return sum(map(len, tokens)) / seconds, tokens


UNFUSED = "eager_unfused"  # an engine of this name runs with the unfused elementwise ops (``unfused_elementwise``)


@contextlib.contextmanager
def unfused_elementwise(on: bool = True):
    """The device layer loop's elementwise work as the torch ops, not the fused kernels, while in the block
    (``SPECDEC_FUSED_ELEMENTWISE=0``, read at each forward)."""
    before = os.environ.get("SPECDEC_FUSED_ELEMENTWISE")
    if on:
        os.environ["SPECDEC_FUSED_ELEMENTWISE"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPECDEC_FUSED_ELEMENTWISE", None)
        else:
            os.environ["SPECDEC_FUSED_ELEMENTWISE"] = before


def interleaved(bench: Bench, engines: dict[str, LLM], prompts, params) -> dict[str, tuple[float, list]]:
    """Median tok/s per engine over ``bench.rounds`` rounds, the order rotating each round, after one warm-up run
    each (captures, compiles); and each engine's tokens. The engine named ``UNFUSED`` runs unfused."""
    for name, llm in engines.items():
        with unfused_elementwise(name == UNFUSED):
            _tps(llm, prompts[:1], params)
    runs: dict[str, list[float]] = {k: [] for k in engines}
    tokens = {}
    names = list(engines)
    for r in range(bench.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            with unfused_elementwise(name == UNFUSED):
                tps, tokens[name] = _tps(engines[name], prompts, params)
            runs[name].append(tps)
    return {k: (statistics.median(v), tokens[k]) for k, v in runs.items()}


def decode(bench: Bench) -> None:
    params = SamplingParams(max_tokens=bench.tokens, ignore_eos=True)
    prompts = bench.id_prompts[:1]
    for dtype in ("bfloat16", "float32"):
        engines = {UNFUSED: bench.llm(bench.model, dtype, graphs=False, max_num_seqs=1),
                   "eager": bench.llm(bench.model, dtype, graphs=False, max_num_seqs=1),
                   "graphs": bench.llm(bench.model, dtype, max_num_seqs=1)}  # fmt: skip
        got = interleaved(bench, engines, prompts, params)
        graphs = engines["graphs"].engine.runner.graphs
        bench.add({"section": "decode", "dtype": dtype, "unfused_tps": got[UNFUSED][0], "eager_tps": got["eager"][0],
                   "graphs_tps": got["graphs"][0], "fused_speedup": got["eager"][0] / got[UNFUSED][0],
                   "speedup": got["graphs"][0] / got["eager"][0], "same_tokens": got["eager"][1] == got["graphs"][1],
                   "same_unfused": got[UNFUSED][1] == got["eager"][1], "replays": graphs.num_replays,
                   "graphs_off": graphs.disabled})  # fmt: skip
        if got["eager"][1] != got["graphs"][1]:
            bench.failures.append(f"decode {dtype}: captured tokens differ from eager")
        del engines


def parity(bench: Bench) -> None:
    params = SamplingParams(max_tokens=bench.tokens, ignore_eos=True)
    cases = [(bench.model, "ngram", {"method": "ngram", "num_speculative_tokens": 4}, bench.id_prompts)]
    if not bench.args.dry_run:  # (the shipped head is SmolLM2's shape; the tiny stand-in is not)
        head = {"method": "eagle", "model": str(MODELS_DIR / "smollm2-eagle3"), "num_speculative_tokens": 3}
        cases.insert(0, (bench.model, "eagle3", head, bench.id_prompts))
    target, draft = default_model_paths()
    cases.append((target, "pair_draft", {"method": "draft_model", "model": draft}, TEXT_PROMPTS))
    for model, name, spec, prompts in cases:
        plain = bench.llm(model, "bfloat16")
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        del plain
        llm = bench.llm(model, "bfloat16", spec=spec)
        outs = llm.generate(prompts, params, use_tqdm=False)
        same = sum(o.outputs[0].token_ids == w for o, w in zip(outs, want))
        accepted = llm.engine.stats["num_accepted"]
        bench.add({"section": "parity", "model": Path(model).name, "drafter": name, "same": f"{same}/{len(prompts)}",
                   "accepted": accepted, "replays": llm.engine.runner.graphs.num_replays})  # fmt: skip
        if same != len(prompts):
            bench.failures.append(f"parity {name}: {len(prompts) - same} of {len(prompts)} requests differ")
        del llm


def launches(bench: Bench) -> None:
    head = {"method": "eagle", "model": str(MODELS_DIR / "smollm2-eagle3"), "num_speculative_tokens": 3}
    specs = {"plain": None, "speculative": None if bench.args.dry_run else head}
    for step, spec in specs.items():
        if step == "speculative" and spec is None:
            spec = {"method": "ngram", "num_speculative_tokens": 3}
        for path in (UNFUSED, "eager", "graphs"):
            llm = bench.llm(bench.model, "bfloat16", graphs=path == "graphs", spec=spec, max_num_seqs=1)
            with unfused_elementwise(path == UNFUSED):
                row = count_step_ops(llm, 8)
            bench.add({"section": "launches", "step": step, "path": path, **row})


def speedup(bench: Bench) -> None:
    target, draft = default_model_paths()
    params = SamplingParams(max_tokens=bench.tokens, ignore_eos=True)
    engines = {
        "plain_eager": bench.llm(target, "bfloat16", graphs=False),
        "plain": bench.llm(target, "bfloat16"),
        "draft_model": bench.llm(target, "bfloat16", spec={"method": "draft_model", "model": draft}),
        "hybrid": bench.llm(target, "bfloat16", spec={"method": "hybrid", "model": draft}),
    }
    got = interleaved(bench, engines, TEXT_PROMPTS, params)
    base = got["plain"][0]
    for name, (tps, tokens) in got.items():
        bench.add({"section": "speedup", "engine": name, "tps": tps, "vs_plain_graphs": tps / base,
                   "same_tokens": tokens == got["plain"][1]})  # fmt: skip


def mechanisms(bench: Bench) -> None:
    params = SamplingParams(max_tokens=bench.tokens, ignore_eos=True)
    for knob in ("recompile_limit", "cache_size_limit"):  # (every bucket's body is one code object to dynamo)
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    names = ["replay"] if bench.args.dry_run else ["cuda_graph", "compile_graph", "reduce_overhead"]
    engines = {}
    for name in names:  # a compile that fails is that row's failure, not the section's
        try:
            engines[name] = bench.llm(bench.model, "bfloat16", graphs=name, max_num_seqs=1)
            _tps(engines[name], bench.id_prompts[:1], params)
        except Exception:
            traceback.print_exc()
            engines.pop(name, None)
            bench.add({"section": "mechanisms", "mechanism": name, "failed": True})
    for name, (tps, _) in interleaved(bench, engines, bench.id_prompts[:1], params).items():
        replays = engines[name].engine.runner.graphs.num_replays
        bench.add({"section": "mechanisms", "mechanism": name, "tps": tps, "replays": replays})


# name -> (the section, the seconds it is expected to take on the device)
SECTIONS = {"decode": (decode, 90), "parity": (parity, 50), "launches": (launches, 40), "speedup": (speedup, 45),
            "mechanisms": (mechanisms, 150)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="SmolLM2's HF directory or GGUF file (default: random weights of "
                    "its shape, written here)")  # fmt: skip
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "gpu"))
    ap.add_argument("--deadline-s", type=float, default=330.0, help="skip what would end past this many seconds")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, run in this order")
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU, tiny models, stand-in graphs")
    args = ap.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s", level=logging.WARNING)
    logging.getLogger("spec_engine.cuda_graphs").setLevel(logging.INFO)  # a line per captured bucket
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_decode: no CUDA device (--dry-run runs the script's logic on the CPU)", file=sys.stderr)
        return 2
    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(random_model(Path(tmp.name) / "smollm2-shaped", TINY if args.dry_run else SMOLLM2))
    bench = Bench(args, model)
    scale = 0.05 if args.dry_run else 1.0
    for name in args.sections.split(","):
        if name not in SECTIONS:
            ap.error(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")
        fn, need_s = SECTIONS[name]
        bench.section(name, need_s * scale, lambda fn=fn: fn(bench))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    summary = {"device": device, "torch": torch.__version__, "model": args.model or "random SmolLM2-shaped",
               "seconds": time.perf_counter() - bench.start, "rows": bench.rows,
               "failures": bench.failures}  # fmt: skip
    (out / "gpu_decode.json").write_text(json.dumps(summary, indent=1))
    print(f"== gpu_decode summary ({device}, torch {torch.__version__}, {summary['seconds']:.0f} s)")
    for row in bench.rows:
        print("   " + " | ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if bench.failures:
        print("FAILED: " + "; ".join(bench.failures))
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
