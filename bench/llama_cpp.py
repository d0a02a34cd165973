"""llama.cpp as a benchmark peer (built under /tmp as bench/llama_cpp.md says; never a dependency): its binaries,
an F16 copy of a GGUF, and one runner per program the benchmarks time - ``llama-bench`` (decode and forward rows),
``llama-batched-bench``, ``llama-speculative-simple`` and ``llama-lookup``.

A sampler here is a callable returning one list of samples per call, as ``bench.bench_step.run_rounds`` takes them.
A llama-bench run that fails (llama.cpp's own crash on some machines) is said once on stderr and leaves its row
empty; the other rows go on.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def binary(root: Path | None, name: str) -> Path | None:
    """``name`` under a llama.cpp source or install directory (``build/bin`` or ``bin``), or None."""
    if root is None:
        return None
    root = Path(root)
    return next((p for p in (root / "build" / "bin" / name, root / "bin" / name, root / name) if p.is_file()), None)


def f16_copy(quantize: Path, src: Path, cache: Path) -> Path:
    """An F16 GGUF of the same tensors (``llama-quantize --allow-requantize``), made once."""
    out = cache / (src.stem + ".F16.gguf")
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(quantize), "--allow-requantize", str(src), str(tmp), "F16"], check=True,
                       capture_output=True)  # fmt: skip
        tmp.rename(out)
    return out


def bench_sampler(llama_bench: Path, model: Path, threads: int, args: list[str],
                  key: str = "samples_ns") -> Callable[[], list[float]]:  # fmt: skip
    """``llama-bench -o json`` once per call: its per-repetition samples of ``key`` (none once it has failed)."""
    cmd = [str(llama_bench), "-m", str(model), "-t", str(threads), "-o", "json", *args]
    failed = []

    def sample() -> list[float]:
        if failed:
            return []
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            failed.append(proc.returncode)
            print(f"  {llama_bench.name} failed (exit {proc.returncode}): {' '.join(cmd[2:])}; its row stays empty",
                  file=sys.stderr, flush=True)  # fmt: skip
            return []
        return [float(x) for x in json.loads(proc.stdout)[0][key]]

    return sample


def decode_sampler(llama_bench: Path, model: Path, threads: int, n: int, ctx: int, reps: int):
    """tok/s of ``n`` generated tokens after a ``ctx``-token context, one sample per repetition."""
    run = bench_sampler(llama_bench, model, threads, ["-p", "0", "-n", str(n), "-d", str(ctx), "-r", str(reps)])
    return lambda: [n / (ns / 1e9) for ns in run()]


def forward_sampler(llama_bench: Path, model: Path, threads: int, T: int, ctx: int, reps: int):
    """ms of one T-token forward at depth ``ctx``: llama-bench's prompt processing of T tokens (one ubatch)."""
    run = bench_sampler(llama_bench, model, threads, ["-p", str(T), "-n", "0", "-d", str(ctx), "-r", str(reps)])
    return lambda: [ns / 1e6 for ns in run()]


def batched(llama_batched_bench: Path, model: Path, threads: int, n: int, ctx: int,
            batches: tuple[int, ...]) -> dict[int, float]:  # fmt: skip
    """{B: summed generation tok/s} from ``llama-batched-bench`` (its S_TG column) for each B in ``batches``."""
    cmd = [str(llama_batched_bench), "-m", str(model), "-t", str(threads), "-c", str(max(batches) * (ctx + n) + 64),
           "-npp", str(ctx), "-ntg", str(n), "-npl", ",".join(map(str, batches))]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[0].isdigit():  # PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | T | S
            rows[int(cells[2])] = float(cells[7])
    return rows


# llama.cpp's logger is a leaked singleton drained by a thread: under load a run can exit (status 0) before its last
# lines, the timing summary included, are written (llama.cpp issue 22142). Such a run is repeated.
LOST_LOG_RETRIES = 5
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ACCEPT = re.compile(r"n_drafted\s*=\s*(\d+).*?n_accept\s*=\s*(\d+)", re.S)


def spec_sampler(spec_bin: Path, gguf: Path, gtype: str, draft_max: int, prompt_files: list[Path], threads: int,
                 max_tokens: int, stats: dict):  # fmt: skip
    """llama.cpp's greedy speculative decoding (target-/draft-``gtype``.gguf in ``gguf``) on every prompt file: one
    tok/s sample per prompt; drafted / accepted counts and lost logs add up in ``stats``."""
    base = [str(spec_bin), "-m", str(gguf / f"target-{gtype}.gguf"), "-md", str(gguf / f"draft-{gtype}.gguf"),
            "-n", str(max_tokens), "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max),
            "--temp", "0", "--top-k", "1", "-t", str(threads), "-td", str(threads), "-c", "256"]  # fmt: skip

    def sample() -> list[float]:
        out = []
        for p in prompt_files:
            for _ in range(LOST_LOG_RETRIES):
                log = subprocess.run([*base, "-f", str(p)], capture_output=True, text=True, check=True)
                text = log.stdout + log.stderr
                m = DECODED.search(text)
                if m is not None:
                    break
                stats["lost_logs"] = stats.get("lost_logs", 0) + 1
            else:
                raise RuntimeError(f"no 'decoded' line from {spec_bin.name} in {LOST_LOG_RETRIES} runs: {text[-500:]}")
            out.append(int(m.group(1)) / float(m.group(2)))
            a = ACCEPT.search(text)
            if a:
                stats["drafted"] = stats.get("drafted", 0) + int(a.group(1))
                stats["accepted"] = stats.get("accepted", 0) + int(a.group(2))
        return out

    return sample


def lookup(llama_lookup: Path, model: Path, texts: list[str], max_tokens: int, threads: int, progress=None) -> dict:
    """llama-lookup (n-gram drafts from the context) on each prompt text: median decode tok/s and its acceptance."""
    tps, accept = [], []
    for text in texts:
        cmd = [str(llama_lookup), "-m", str(model), "-t", str(threads), "-c", "4096", "-n", str(max_tokens),
               "--temp", "0", "-p", text]  # fmt: skip
        log = subprocess.run(cmd, capture_output=True, text=True).stderr
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
        a = re.search(r"accept\s+=\s+([\d.]+)%", log)
        if m:
            tps.append(float(m.group(3)))
            accept.append(float(a.group(1)) / 100 if a else float("nan"))
        if progress is not None:
            progress.update(1)
    return {"tokens_per_s": statistics.median(tps) if tps else None, "samples": tps,
            "acceptance": statistics.mean(accept) if accept else None}  # fmt: skip
