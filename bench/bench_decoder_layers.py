"""decoder_layers: the native one-call forward against the same layers as torch ops around the fast kernels.

    python bench/bench_decoder_layers.py [--threads 1] [--dtype float32] [--rounds 5] [--quick]

For the default pair's target and draft, batch 1, a paged cache holding L committed tokens, T new tokens (a chain):
the median [p20, p80] time of one ``decoder_layers`` call per mode over interleaved rounds (every mode once per
round, so load drift hits all alike), the weight bytes streamed per microsecond (a batch-1 forward reads every
weight once: the memory roofline), and the ratio to the native call.

Modes:
    native     the C++ op (csrc/decoder_layers_cpu.cpp), what the engine runs on CPU
    torch-ops  the same computation as torch ops around ``linear`` and ``tree_attention`` (the device path's loop)
    matmuls    only the four ``linear`` calls per layer on [T, in] activations: the floor the op's overhead sits on
    control    native again under another name: |control / native - 1| is the run's noise
JSON goes to bench/out/bench_decoder_layers.json with the machine's name and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root, not bench/, heads the import path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec_engine import default_model_paths  # noqa: E402
from spec_engine.models.loader import load_model  # noqa: E402
from spec_kernels import linear  # noqa: E402
from spec_kernels.decoder_layers import _device_layers, decoder_layers  # noqa: E402

BLOCK = 16


def make_case(model, L: int, T: int):
    cfg = model.config
    dtype = model.lm_head.weight.dtype
    blocks = (L + T) // BLOCK + 1
    kv = torch.randn(cfg.num_hidden_layers, 2, blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim).to(dtype)
    table = torch.arange(blocks, dtype=torch.int32)[None]  # [1, blocks]
    cache_seqlens = torch.tensor([L], dtype=torch.int32)
    positions = cache_seqlens.long()[:, None] + torch.arange(T)  # [1, T]
    hidden = model.model.embed_tokens(torch.randint(0, cfg.vocab_size, (1, T)))  # [1, T, H]
    rope = model._rope(positions, dtype)  # [2, 1, T, D]
    mask = torch.ones(1, T, T, dtype=torch.bool).tril()
    args = (hidden, model.layer_weights, model.model.norm.weight, kv, cache_seqlens, rope, mask)
    kw = dict(num_heads=cfg.num_attention_heads, eps=cfg.rms_norm_eps, block_table=table)
    mats = [w for i, w in enumerate(model.layer_weights) if i % 9 in (1, 3, 5, 6)]  # qkv, o, gate_up, down
    xs = {w.shape[1]: torch.randn(T, w.shape[1]).to(dtype) for w in mats}
    modes = {
        "native": lambda: decoder_layers(*args, **kw),
        "torch-ops": lambda: _device_layers(*args, table, kw["num_heads"], kw["eps"]),
        "matmuls": lambda: [linear(xs[w.shape[1]], w) for w in mats],
        "control": lambda: decoder_layers(*args, **kw),
    }
    weight_bytes = sum(w.numel() * w.element_size() for w in model.layer_weights if w is not None)
    return modes, weight_bytes


def time_call(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3  # ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and rounds")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "bench_decoder_layers.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rounds = 2 if args.quick else args.rounds
    shapes = [(64, 1), (64, 16)] if args.quick else [(64, 1), (64, 4), (64, 16), (200, 1), (200, 16), (500, 16)]
    rows = []
    with torch.inference_mode():
        for name, path in zip(("target", "draft"), default_model_paths()):
            model = load_model(path, dtype=dtype, device="cpu").fuse(1024)
            for L, T in shapes:
                modes, weight_bytes = make_case(model, L, T)
                reps = max(3, int(0.05 / max(time_call(modes["native"], 3) / 1e3, 1e-6)))
                times = {m: [] for m in modes}
                for r in range(rounds):
                    order = list(modes)[r % len(modes) :] + list(modes)[: r % len(modes)]
                    for m in order:
                        times[m].append(time_call(modes[m], reps))
                native = statistics.median(times["native"])
                for m, ts in times.items():
                    q = statistics.quantiles(ts, n=5) if len(ts) > 1 else [ts[0]] * 4
                    med = statistics.median(ts)
                    row = dict(model=name, L=L, T=T, mode=m, ms=med, p20=q[0], p80=q[3], vs_native=med / native,
                               weight_gb_s=weight_bytes / (med / 1e3) / 1e9)  # fmt: skip
                    rows.append(row)
                    print(f"{name:6s} L={L:3d} T={T:2d} {m:9s} {med:7.3f} ms [{q[0]:.3f}, {q[3]:.3f}]  "
                          f"{row['weight_gb_s']:6.1f} GB/s  {med / native:5.2f}x native", flush=True)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=platform.node(), load=os.getloadavg(), threads=args.threads, dtype=args.dtype, rounds=rounds)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
