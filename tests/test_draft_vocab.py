"""A draft's reduced vocabulary (FR-Spec): its logits over the most frequent token ids only.

Greedy: the tokens of plain decoding, every draft inside the ids, and the native chain steps proposing exactly what
the regular steps propose (a planted bug, the native call given no id map, must show). Sampling: lossless by chi2
against the target's exact distribution, with a planted bug rejected. Bad files and configs raise ValueError.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from test_engine_sampling import P_BUG, P_MIN, N, V, chi2_pvalue, exact_joint, sample_joint
from tiny_models import make_model, make_noisy_copy

import spec_engine.runner as runner_mod
from spec_engine import LLM, SamplingParams
from spec_engine.drafters.draft_model import DRAFT_VOCAB_FILE, DraftModelDrafter, read_draft_vocab, write_draft_vocab
from spec_engine.engine import EngineConfig

PROMPTS = [[5, 17, 3, 60, 42, 7, 5, 17, 3], [1, 2, 3, 4, 1, 2], list(range(10, 40))]
STEP_METRICS = ("num_steps", "num_drafted", "num_accepted", "accepted_length_hist")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target (vocab 96), its noisy copy as the draft with draft_vocab.json ranked on the target's own text (48
    ids by default), and the ids."""
    root = tmp_path_factory.mktemp("draft_vocab")
    target = make_model(root / "target", "llama_gqa", logit_scale=4.0)
    draft = make_noisy_copy(target, root / "draft", noise=0.05)
    plain = LLM(str(target))
    outs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=60, ignore_eos=True),
                          use_tqdm=False)  # fmt: skip
    stream = torch.tensor([t for o in outs for t in o.prompt_token_ids + o.outputs[0].token_ids])
    write_draft_vocab(stream, 96, draft, size=48)
    return target, draft, read_draft_vocab(draft, 96, None)


def generate(llm: LLM, params: SamplingParams, steps: int) -> list:
    llm.engine.reconfigure(EngineConfig(spec_chain_steps=steps))
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def test_the_file_ranks_ids_by_count_and_sets_the_default_size(tmp_path):
    write_draft_vocab(torch.tensor([3, 3, 3, 1, 1, 7]), 8, tmp_path, size=2)
    spec = json.loads((tmp_path / DRAFT_VOCAB_FILE).read_text())
    assert spec["size"] == 2 and spec["token_ids"][:3] == [3, 1, 7] and sorted(spec["token_ids"]) == list(range(8))
    assert read_draft_vocab(tmp_path, 8, None).tolist() == [3, 1]
    assert read_draft_vocab(tmp_path, 8, 3).tolist() == [3, 1, 7]
    assert read_draft_vocab(tmp_path, 8, 8) is None  # the whole vocabulary: no restriction
    assert read_draft_vocab(tmp_path / "missing", 8, None) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_and_drafts(pair, dtype, monkeypatch):
    target, draft, ids = pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    full = LLM(str(target), speculative_config={**spec, "draft_vocab_size": 96}, dtype=dtype)
    llm = LLM(str(target), speculative_config=spec, dtype=dtype)  # the file's default: 48 ids
    assert llm.engine.drafter.model.vocab_map.tolist() == sorted(ids.tolist())
    params = SamplingParams(max_tokens=33, ignore_eos=True)
    proposed = []
    real = DraftModelDrafter.propose

    def spy(self, batch):
        draft_ = real(self, batch)
        proposed.extend(draft_.tokens[:, 1:].flatten().tolist())
        return draft_

    monkeypatch.setattr(DraftModelDrafter, "propose", spy)
    ref = generate(full, params, 0)
    proposed.clear()
    regular = generate(llm, params, 0)
    assert proposed and set(proposed) <= set(ids.tolist())  # every draft inside the reduced vocabulary
    native = generate(llm, params, 4)
    for a, b, c in zip(ref, regular, native):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert {k: b.metrics[k] for k in STEP_METRICS} == {k: c.metrics[k] for k in STEP_METRICS}
    assert sum(o.metrics["num_accepted"] for o in native) > 0


def test_planted_bug_native_chain_without_the_id_map(pair, monkeypatch):
    """The native-vs-regular comparison can fail: a native call that reads the reduced logits' indices as token ids
    proposes other tokens, and its acceptances differ."""
    target, draft, _ = pair
    llm = LLM(str(target), speculative_config={"method": "draft_model", "model": str(draft),
                                               "num_speculative_tokens": 3})  # fmt: skip
    params = SamplingParams(max_tokens=33, ignore_eos=True)
    regular = generate(llm, params, 0)
    real = runner_mod.spec_chain

    def unmapped(t, d, *args, **kw):
        return real(t, dataclasses.replace(d, vocab_map=None), *args, **kw)

    monkeypatch.setattr(runner_mod, "spec_chain", unmapped)
    native = generate(llm, params, 4)
    assert [o.metrics["num_accepted"] for o in native] != [o.metrics["num_accepted"] for o in regular]


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    """The chi2 setting of test_engine_sampling (vocab 6) with a draft restricted to its 3 most likely ids."""
    root = tmp_path_factory.mktemp("draft_vocab_sampling")
    target = make_model(root / "target", "llama_gqa", vocab_size=V, hidden=32, logit_scale=2.0)
    draft = make_noisy_copy(target, root / "draft", noise=0.5)
    p = exact_joint(target, 1.0, 1.0).reshape(V, V)
    ranked = np.argsort(-(p.sum(1) + p.sum(0)), kind="stable")
    write_draft_vocab(torch.tensor(np.repeat(ranked, np.arange(V, 0, -1))), V, draft, size=3)
    return target, draft


def test_sampling_with_a_reduced_draft_vocabulary_is_lossless(sampling_pair, monkeypatch):
    target, draft = sampling_pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2, "tree": [2, 2]}
    llm = LLM(str(target), speculative_config=spec, max_model_len=32, max_num_seqs=512)
    assert llm.engine.drafter.model.vocab_map.numel() == 3
    counts = sample_joint(llm, 1.0, 1.0)
    assert llm.engine.stats["num_accepted"] > N // 4, "the draft must be accepted often for this test to bite"
    exact = exact_joint(target, 1.0, 1.0)
    assert chi2_pvalue(counts, exact) > P_MIN
    # planted: children taken greedily while reported as drawn from q: chi2 must reject it here too
    monkeypatch.setattr(DraftModelDrafter, "_draw_children", lambda self, q, b, *a: q.topk(b, dim=-1).indices)
    assert chi2_pvalue(sample_joint(llm, 1.0, 1.0), exact) < P_BUG


def test_bad_configs_and_files_raise(pair, tmp_path):
    target, draft, _ = pair
    for bad in (0, -1, 1.5, True, "48"):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            LLM(str(target), speculative_config={"model": str(draft), "draft_vocab_size": bad})
    with pytest.raises(ValueError, match="needs method='draft_model'"):
        LLM(str(target), speculative_config={"method": "ngram", "draft_vocab_size": 8})
    with pytest.raises(ValueError, match="narrower than the tree's widest level"):  # sampled without replacement,
        # b children need b ids with q > 0 (3 children from 2 ids: chi2 p = 3e-302, the review's reproduction)
        LLM(str(target), speculative_config={"model": str(draft), "draft_vocab_size": 2, "tree": [3, 2]})
    with pytest.raises(ValueError, match="must lie in"):
        LLM(str(target), speculative_config={"model": str(draft), "draft_vocab_size": 97})
    bare = shutil.copytree(draft, tmp_path / "bare")
    (bare / DRAFT_VOCAB_FILE).unlink()
    with pytest.raises(ValueError, match="needs .*draft_vocab.json"):
        LLM(str(target), speculative_config={"model": str(bare), "draft_vocab_size": 8})
    bad_files = [{"size": 4}, {"size": 4, "token_ids": [1, 1, 2, 3]}, {"size": 2, "token_ids": [0, 96]},
                 {"size": 4.5, "token_ids": list(range(96))}]  # fmt: skip
    for text in ["not json"] + [json.dumps(f) for f in bad_files]:
        (bare / DRAFT_VOCAB_FILE).write_text(text)
        with pytest.raises(ValueError, match="draft_vocab.json"):
            LLM(str(target), speculative_config={"model": str(bare)})
