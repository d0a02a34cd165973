"""Kernel launches (CUDA) or ATen ops (CPU) per decode step, counted with the torch profiler: plain and speculative
steps, eager and with the forwards captured (spec_engine/cuda_graphs.py).

    python bench/count_launches.py [--model DIR] [--device cpu|cuda] [--dtype bfloat16] [--steps 8] [--json OUT]

Each row runs the regular (Python-driven) step, the one CUDA runs (on a CPU the native multi-step calls are turned
off). Columns per decode step:
- ``ops``: ATen and custom ops dispatched from Python (top-level: an op another op calls is not counted);
- ``in_graph``: those inside the captured forward (CPU and meta: the "replay" stand-in re-runs them, so the count is
  what a CUDA graph would launch at once; 0 when eager);
- ``launches`` (CUDA): host launch calls (kernels, memcpy/memset, graph launches) and ``kernels``, the kernels that
  ran on the device.
On CUDA ``ops - in_graph`` is what the host still dispatches one by one around a replay. ``--device meta`` counts the
CUDA path's ops on a CPU machine (the forward as torch ops around the Triton kernels; the step's one read of device
data planted: every draft rejected), the proxy to report where no GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from spec_engine import LLM, SamplingParams, default_model_paths  # noqa: E402
from spec_engine.cuda_graphs import MECHANISMS  # noqa: E402
from spec_engine.engine import EngineConfig  # noqa: E402
from spec_engine.runner import StepRunner  # noqa: E402

CAPTURED = "captured_forward"  # the profiler region around a replay
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")  # fmt: skip
PROMPT = [{"prompt_token_ids": [5, 17, 3, 60, 42, 7, 5, 17, 3, 60, 42, 7]}]


def _is_op(name: str) -> bool:
    return name.startswith("aten::") or name.startswith("spec_kernels::")


def count_step_ops(llm: LLM, steps: int) -> dict:
    """Profile ``steps`` decode steps of one greedy request (prefill and bucket captures before, unprofiled)."""
    engine = llm.engine
    req = engine.add_request(PROMPT[0]["prompt_token_ids"], SamplingParams(max_tokens=(steps + 4) * 17,
                                                                            ignore_eos=True))  # fmt: skip
    for _ in range(4):  # the prefill and the first decode steps (captures, Triton compiles)
        engine.step()
    patched = {cls: cls.replay for cls in MECHANISMS.values() if "replay" in vars(cls)}
    for cls, real in patched.items():  # a region around every replay (either model's): captured ops apart
        cls.replay = lambda self, real=real: _in_region(lambda: real(self))
    cuda = llm.engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            if cuda:
                torch.cuda.synchronize()
    finally:
        for cls, real in patched.items():
            cls.replay = real
    engine.abort(req.request_id)
    ran = steps  # (one decode call a step: the regular step)
    ops = in_graph = launches = kernels = 0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            continue
        if evt.name in LAUNCH_CALLS:
            launches += 1
        parent = evt.cpu_parent
        if not _is_op(evt.name) or (parent is not None and _is_op(parent.name)):
            continue
        ops += 1
        while parent is not None and parent.name != CAPTURED:
            parent = parent.cpu_parent
        in_graph += parent is not None
    row = {"steps": ran, "ops": ops / ran, "in_graph": in_graph / ran}
    if cuda:
        row |= {"launches": launches / ran, "kernels": kernels / ran}
    return row


def _planted_read(result, parents=None) -> tuple[list, list, list, list]:
    """The meta device's stand-in for the step's one device read: the root's token again, nothing accepted (a tree's
    path: its root)."""
    B, T = result.output_tokens.shape
    trees = ([[0] * T] * B, [[-1] * T] * B) if parents is not None else ([], [])
    return [[7] * T for _ in range(B)], [1] * B, *trees


def _in_region(replay) -> None:
    with record_function(CAPTURED):
        replay()


def rows(model: str, draft: str | None, device: str, dtype: str, steps: int, method: str = "draft_model") -> list[dict]:
    """Plain and speculative (``method``'s chains at depth 3: verify width 4; "draft_model" and "eagle" read
    ``draft``), each eager and captured."""
    mechanism = None if device == "cuda" else "replay"
    out = []
    specs = {"plain": None}
    if draft or method == "ngram":
        specs["speculative"] = {"method": method, "num_speculative_tokens": 3} | ({"model": draft} if draft else {})
    for name, spec in specs.items():
        for eager in (True, False):
            config = EngineConfig(plain_chain=1, spec_chain_steps=0, native_tree_step=False, enforce_eager=eager,
                                  graph_mechanism=None if eager else mechanism)  # fmt: skip
            llm = LLM(model, speculative_config=spec, device=device, dtype=dtype, engine_config=config)
            row = {"step": name, "path": "eager" if eager else "graphs", **count_step_ops(llm, steps)}
            out.append(row)
            print(
                " | ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target directory (default: the embedded target)")
    ap.add_argument("--draft", default=None, help="draft directory (default: the embedded draft with the embedded "
                    "target; none otherwise)")  # fmt: skip
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "eagle", "ngram"],
                    help="the speculative rows' drafter")  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if args.device == "meta":
        StepRunner._read_step = staticmethod(_planted_read)
    target, draft = default_model_paths()
    model = args.model or target
    draft = args.draft or (draft if args.model is None else None)
    out = rows(model, None if args.method == "ngram" else draft, args.device, args.dtype, args.steps, args.method)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
