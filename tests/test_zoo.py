"""The embedded default pair: it loads in our engine and in HF transformers, speculation is lossless on it, the CLI
runs on it, and the training recipe works end to end on tiny configs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from spec_engine import LLM, SamplingParams, default_model_paths
from spec_engine.training import train

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def paths():
    return default_model_paths()


def test_default_pair_is_small_and_complete(paths):
    from pathlib import Path

    total = 0
    for d in map(Path, paths):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
            assert (d / name).is_file(), name
        total += sum(f.stat().st_size for f in d.iterdir())
    assert total <= 40 * 2**20
    t, d = (json.loads((Path(p) / "config.json").read_text()) for p in paths)
    assert t["vocab_size"] == d["vocab_size"]
    ranked = json.loads((Path(paths[1]) / "draft_vocab.json").read_text())  # the draft's reduced vocabulary
    assert sorted(ranked["token_ids"]) == list(range(d["vocab_size"])) and 1 <= ranked["size"] <= d["vocab_size"]


def test_default_pair_loads_in_hf_and_agrees_with_our_model(paths):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_engine.models import load_model

    target = paths[0]
    tok = AutoTokenizer.from_pretrained(target)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ours = load_model(target)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.forward_train(ids)
    assert torch.allclose(got, ref, atol=2e-4, rtol=1e-4)


def test_speculative_greedy_equals_plain_greedy(paths):
    target, draft = paths
    params = SamplingParams(max_tokens=32)
    spec = LLM(target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4})
    plain = LLM(target)
    a = spec.generate(PROMPT, params, use_tqdm=False)[0]
    b = plain.generate(PROMPT, params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == b.outputs[0].text
    assert a.metrics["mean_accepted_length"] > 1.5  # the distilled draft is really accepted


def test_default_pair_takes_a_long_context(paths):
    """v2 of the pair trained to 2048 tokens: a 1500-token prompt and new tokens run, speculated, with the tokens of
    plain decoding."""
    target, draft = paths
    spec = LLM(target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    assert spec.max_model_len >= 2048
    ids = (spec.encode(open(train.__file__).read()) * 4)[:1500]  # [1500] tokens of the recipe's own source
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    a = spec.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    b = LLM(target).generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 16


def test_cli_generate_prints_text_and_stats():
    out = subprocess.run(
        [sys.executable, "-m", "spec_engine.cli", "generate", "--prompt", PROMPT, "--max-tokens", "16"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(PROMPT)
    assert "tok/s" in out.stdout and "alpha=" in out.stdout and "tau=" in out.stdout


def test_cli_reports_bad_input_cleanly():
    out = subprocess.run(
        [sys.executable, "-m", "spec_engine.cli", "generate", "--prompt", "x", "--temperature", "-1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2
    assert "error: temperature" in out.stderr and "Traceback" not in out.stderr


def test_training_recipe_smoke(tmp_path):
    report = train.main(["--smoke", "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out")])
    assert report["held_out_ppl_target"] > 1
    llm = LLM(str(tmp_path / "out" / "target"),
              speculative_config={"method": "draft_model", "model": str(tmp_path / "out" / "draft")})  # fmt: skip
    assert len(llm.generate("x = ", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert llm.engine.drafter.model.vocab_map is None  # the smoke vocabulary (300) is within draft_vocab_size
    # resumable: a second run finds the checkpoints and does not retrain; without --out-dir a smoke run exports into
    # its work directory, never over the shipped pair (the embedded default, and the head trained against it)
    shipped = train.DEFAULT_OUT / "target" / "model.safetensors"
    before = shipped.read_bytes() if shipped.exists() else None
    again = train.main(["--smoke", "--work-dir", str(tmp_path / "work")])
    assert again["held_out_ppl_target"] == pytest.approx(report["held_out_ppl_target"])
    assert (tmp_path / "work" / "export" / "target" / "config.json").is_file()
    assert (shipped.read_bytes() if shipped.exists() else None) == before


def test_eagle_prompt_set_keeps_the_benchmarks_functions_out():
    """The function stubs and edits come from the training half of the stdlib's files only: no function the edit
    benchmark asks about (the held-out half) is in the shipped prompt set, nor any of the chat benchmark's requests;
    and the added kinds leave the earlier kinds' ids as they were."""
    from bench.bench_drafters import CHAT
    from bench.bench_suffix import functions
    from spec_engine.training.eagle_prompts import build, stdlib_functions

    shipped = [json.loads(line)["prompt"] for line in (train.Path(train.__file__).parent / "data" /
               "eagle_prompts.jsonl").read_text().splitlines()]  # fmt: skip
    benchmarked = functions(40)
    assert len(benchmarked) >= 20
    assert not any(src in p for src in benchmarked for p in shipped)
    assert not any(src in source for _, source in stdlib_functions() for src in benchmarked)
    small, more = build(0, 40, 10, 20), build(0, 40, 10, 20, n_complete=30, n_source_edit=10)
    assert more[: len(small)] == small
    assert {p["kind"] for p in more[len(small) :]} == {"complete", "source edit"}
    later = build(0, 40, 10, 20, n_complete=30, n_source_edit=10, n_more_complete=25)
    assert later[: len(more)] == more  # appended stubs leave every earlier id as it was
    added = later[len(more) :]
    assert 20 <= len(added) <= 25 and {p["kind"] for p in added} == {"complete"}
    new = {p["prompt"] for p in added}
    assert len(new) == len(added) and not new & {p["prompt"] for p in more}  # each new, once
    chat = build(0, 40, 10, 20, n_complete=30, n_source_edit=10, n_more_complete=25, n_more_chat=50)
    assert chat[: len(later)] == later and len(chat) == len(later) + 50
    assert {p["kind"] for p in chat[len(later) :]} == {"everyday"}
    assert len({p["prompt"] for p in chat}) == len(chat)
    assist = build(0, 40, 10, 20, n_complete=30, n_source_edit=10, n_more_complete=25, n_more_chat=50, n_assist=40)
    assert assist[: len(chat)] == chat and {p["kind"] for p in assist[len(chat) :]} == {"assist"}
    assert len(assist) == len(chat) + 40 and len({p["prompt"] for p in assist}) == len(assist)
    assert not set(CHAT) & set(shipped) and sum(p.startswith("How do I") for p in shipped) >= 50
    # nor is an assistant request about a chat benchmark request's subject (its words, whole or as a stem)
    words = ["focus", "working from home", "weather", "climate", "tomato", "pasta", "sky", "sunset", "bakery",
             "interest", "bicycle", "dog", "romeo", "virus", "interview", "sunlight", "budget", "traffic", "tea",
             "leap year", "calendar", "plastic", "report", "colleague"]  # fmt: skip
    stems = ["pack", "hik", "retire", "adopt", "bacteri", "photosynth", "vaccin"]
    subject = re.compile(r"\b(" + "|".join(words) + r")s?\b|\b(" + "|".join(stems) + ")", re.IGNORECASE)
    assert all(subject.search(q) for q in CHAT)  # every benchmark request's subject is among them
    assist = [json.loads(line)["prompt"] for line in (train.Path(train.__file__).parent / "data" /
              "eagle_prompts.jsonl").read_text().splitlines() if json.loads(line)["kind"] == "assist"]  # fmt: skip
    assert len(assist) >= 500 and not [p for p in assist if subject.search(p)]


def test_a_work_dir_belongs_to_one_run(tmp_path):
    """A work directory's caches and checkpoints are its first run's: a run with other inputs is refused (it would
    silently resume from and train on the first run's token streams), one with the same inputs resumes."""
    from spec_engine.training.train import claim_work_dir

    claim_work_dir(tmp_path / "w", layout="eagle3", target=tmp_path / "a", max_files=2)
    claim_work_dir(tmp_path / "w", layout="eagle3", target=tmp_path / "a", max_files=2)  # the same: resumes
    with pytest.raises(ValueError, match="max_files.*2 -> 8.*another --work-dir"):
        claim_work_dir(tmp_path / "w", layout="eagle3", target=tmp_path / "a", max_files=8)
