"""The names and checks of ``LLM``'s settings: the dtype names it takes (``DTYPES``; which one "auto" picks is
``llm.auto_dtype``'s) and its ``speculative_config`` (methods, keys, defaults, the adaptive caps). Parsing reads no
weights but a drafter directory's tensor names (``is_eagle_head``)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from spec_engine.drafters import suffix as suffix_defaults
from spec_engine.drafters.factory import AUTO_EAGLE_TOPK, DEFAULT_EAGLE_TOPK
from spec_engine.drafters.ngram import NGRAM_MAX_N

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "auto": adaptive (spec_engine/adaptive.py)
DEFAULT_NUM_SPECULATIVE_TOKENS = {"draft_model": "auto", "eagle": "auto", "ngram": "auto", "suffix": "auto",
                                  "hybrid": "auto"}  # fmt: skip
ADAPTIVE_MAX_GAMMA = 8  # the deepest chain "auto" may draft; a static tree caps it at its own depth
# ... for an EAGLE head's chains (alone or in the hybrid): its acceptance falls with depth past the steps its
# training-time test unrolled, which the controller's one acceptance rate per row does not see, and its deep steps
# cost more than they keep (bench/RESULTS-log.md, "The adaptive head's maximum depth")
EAGLE_ADAPTIVE_MAX_GAMMA = 4
# suffix speculations under "auto": the most nodes a row's tree may have (a repeated passage is accepted whole, so
# deeper than a model's chains; the adaptive controller still picks each row's cap from what the rows accepted)
SUFFIX_ADAPTIVE_MAX_TOKENS = 16
# An EAGLE head's shape with adaptive depth on a CPU when "tree" is left out: "auto", a chain or a dynamic tree of
# AUTO_EAGLE_TOPK nodes a level chosen each step (bench/RESULTS.md, "Dynamic trees against chains"); "chain" asks for
# the chains alone. Elsewhere (a GPU) the chains stay the default: trees there are unmeasured.
DEFAULT_HEAD_TREE = "auto"
MAX_SUFFIX_TOKENS = 32  # the largest num_speculative_tokens (tree nodes) of method="suffix"
SPECULATIVE_METHODS = tuple(DEFAULT_NUM_SPECULATIVE_TOKENS)
MODEL_METHODS = ("draft_model", "eagle")  # drafters with weights, proposing chains or static trees
WEIGHTED_METHODS = (*MODEL_METHODS, "hybrid")  # the methods that take a "model" (the hybrid wraps one)
# suffix decoding's keys: vLLM's where vLLM has the knob (SpeculativeConfig.suffix_decoding_*), ours otherwise
SUFFIX_KEYS = {
    "suffix_decoding_max_tree_depth": suffix_defaults.MAX_TREE_DEPTH,
    "suffix_decoding_max_spec_factor": suffix_defaults.MAX_SPEC_FACTOR,
    "suffix_decoding_min_token_prob": suffix_defaults.MIN_TOKEN_PROB,
    "suffix_decoding_max_cached_requests": suffix_defaults.MAX_CACHED_REQUESTS,
    "suffix_decoding_use_tree_spec": True,  # ArcticInference's use_tree_spec: trees (True) or chains
    "suffix_decoding_min_score": suffix_defaults.MIN_SCORE,  # the least expected accepted tokens worth a draft
    "suffix_decoding_max_spec_tokens": SUFFIX_ADAPTIVE_MAX_TOKENS,  # hybrid: a suffix row's most nodes
}


def parse_speculative_config(spec: dict | None, device: str | torch.device = "cpu") -> dict | None:
    """``LLM(speculative_config=...)`` checked, defaults filled in: the dict given plus "method", "model_method"
    (the drafter with weights: "draft_model", "eagle", or None where none is named yet or the method has none),
    "num_speculative_tokens" (an int: "auto"'s cap), "adaptive", "suffix" (``_parse_suffix_keys``), "tree" (an
    EAGLE head's ``DEFAULT_HEAD_TREE`` on a CPU ``device`` where left out; "chain": None) and "widths" (tree="auto":
    {1: the chains' deepest, eagle_topk: the dynamic trees'}, the widths the adaptive controller picks from each step;
    else None). None: no speculation. ValueError names the key at fault."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError("speculative_config must be a dict or None")
    method = spec.get("method", "draft_model" if "model" in spec else None)
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {method!r}")
    known = {"method", "model", "num_speculative_tokens", "tree", "draft_sampling", "max_n", "min_n", "eagle_topk",
             "draft_vocab_size", "draft_dtype", *SUFFIX_KEYS}  # fmt: skip
    unknown = set(spec) - known
    if unknown:
        raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
    suffix = _parse_suffix_keys(spec, method)
    if method not in WEIGHTED_METHODS:  # (keys a model-free method would otherwise take and ignore)
        for key in ("model", "draft_sampling"):
            if key in spec:
                raise ValueError(f"speculative_config.{key} needs a drafter with weights (method 'draft_model', "
                                 f"'eagle' or 'hybrid'), not {method!r}")  # fmt: skip
    tree = spec.get("tree")
    gamma = spec.get("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS[method])
    adaptive = gamma == "auto"
    hybrid_head = method == "hybrid" and bool(spec.get("model")) and is_eagle_head(spec["model"])
    if tree == "chain":
        if method not in WEIGHTED_METHODS:
            raise ValueError("tree='chain' (a model drafter's chains) needs method='draft_model', 'eagle' or 'hybrid'")
        tree = None
    elif tree is None and adaptive and (method == "eagle" or hybrid_head) and torch.device(device).type == "cpu":
        tree = DEFAULT_HEAD_TREE
    unnamed = method in WEIGHTED_METHODS and not spec.get("model")  # LLM parses again with the drafter shipped
    # (a hybrid's default tree is "auto" where that drafter is an EAGLE head: its eagle_topk is checked then)
    head_unknown = unnamed and method == "hybrid" and spec.get("tree") is None
    if "eagle_topk" in spec and tree not in ("dynamic", "auto") and not head_unknown:
        raise ValueError("eagle_topk (nodes a level of EAGLE-2's dynamic tree) needs tree='dynamic' or 'auto'")
    if tree == "auto" and not adaptive:
        raise ValueError("tree='auto' (the adaptive controller picks a chain or EAGLE-2's dynamic tree each step) "
                         f"needs num_speculative_tokens='auto', got {gamma!r}")  # fmt: skip
    if adaptive:
        default = SUFFIX_ADAPTIVE_MAX_TOKENS if method == "suffix" else ADAPTIVE_MAX_GAMMA
        if (method == "eagle" or hybrid_head) and tree is None:  # (chains: a dynamic tree keeps its own choice)
            default = EAGLE_ADAPTIVE_MAX_GAMMA
        gamma = len(tree) if isinstance(tree, (list, tuple)) and tree else default
    most = MAX_SUFFIX_TOKENS if method == "suffix" else 16
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= most:
        raise ValueError(f"num_speculative_tokens must be 'auto' or an int in [1, {most}], got {gamma!r}")
    widths = None
    if tree in ("dynamic", "auto"):
        if method not in ("eagle", "hybrid"):
            raise ValueError(f"tree={tree!r} (EAGLE-2's dynamic tree) needs method='eagle' or 'hybrid' (an EAGLE head)")
        topk = spec.get("eagle_topk", AUTO_EAGLE_TOPK if tree == "auto" else DEFAULT_EAGLE_TOPK)
        least = 2 if tree == "auto" else 1  # (auto's width 1 is the chain)
        if isinstance(topk, bool) or not isinstance(topk, int) or not least <= topk <= 16:
            raise ValueError(f"eagle_topk must be an int in [{least}, 16], got {topk!r}")
        if tree == "auto":  # the chains' deepest as an EAGLE head's chains alone (EAGLE_ADAPTIVE_MAX_GAMMA's reason)
            widths = {1: min(EAGLE_ADAPTIVE_MAX_GAMMA, gamma), topk: gamma}
    elif tree is not None:
        if method not in WEIGHTED_METHODS:
            raise ValueError("a static 'tree' needs method='draft_model', 'eagle' or 'hybrid'")
        if not isinstance(tree, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in tree
        ):
            raise ValueError(f"speculative_config.tree must be a list of positive ints, got {tree!r}")
        if len(tree) > gamma:
            raise ValueError(f"tree depth {len(tree)} exceeds num_speculative_tokens {gamma}")
        if math.prod(tree) > 64:
            raise ValueError(f"tree {list(tree)} has {math.prod(tree)} leaves; at most 64 are supported")
    vocab = spec.get("draft_vocab_size")
    if vocab is not None:
        if method not in ("draft_model", "hybrid"):
            raise ValueError("draft_vocab_size (a reduced draft vocabulary) needs method='draft_model'")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"draft_vocab_size must be a positive int, got {vocab!r}")
    draft_dtype = spec.get("draft_dtype")
    if draft_dtype is not None:
        if method not in ("draft_model", "hybrid"):
            raise ValueError("draft_dtype (the draft model's precision) needs method='draft_model'")
        if draft_dtype not in DTYPES:
            raise ValueError(f"draft_dtype must be one of {list(DTYPES)}, got {draft_dtype!r}")
    if "max_n" in spec or "min_n" in spec:
        if method != "ngram":
            raise ValueError("max_n and min_n (the n-gram lengths matched) need method='ngram'")
        for name in ("max_n", "min_n"):
            n = spec.get(name, 1)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if spec.get("min_n", 1) > spec.get("max_n", NGRAM_MAX_N):
            raise ValueError(f"min_n ({spec.get('min_n', 1)}) exceeds max_n ({spec.get('max_n', NGRAM_MAX_N)})")
    if unnamed:  # LLM fills in the shipped drafter
        return {**spec, "method": method, "model_method": None, "num_speculative_tokens": gamma,
                "adaptive": adaptive, "suffix": suffix, "tree": tree, "widths": widths}  # fmt: skip
    model_method = method
    if method == "hybrid":
        model_method = "eagle" if hybrid_head else "draft_model"
        if tree in ("dynamic", "auto") and model_method != "eagle":
            raise ValueError(f"tree={tree!r} (EAGLE-2's dynamic tree) needs an EAGLE head, not a draft model")
        if (vocab is not None or draft_dtype is not None) and model_method != "draft_model":
            raise ValueError("draft_vocab_size and draft_dtype need a draft model, not an EAGLE head")
    return {**spec, "method": method, "model_method": model_method, "num_speculative_tokens": gamma,
            "adaptive": adaptive, "suffix": suffix, "tree": tree, "widths": widths}  # fmt: skip


def _parse_suffix_keys(spec: dict, method: str) -> dict | None:
    """The suffix drafter's settings (``SUFFIX_KEYS``, defaults filled in) for methods "suffix" and "hybrid"; None
    for the others, which take no suffix key."""
    given = {k for k in spec if k in SUFFIX_KEYS}
    if method not in ("suffix", "hybrid"):
        if given:
            raise ValueError(f"{sorted(given)} need method='suffix' or 'hybrid'")
        return None
    if method == "suffix" and "suffix_decoding_max_spec_tokens" in given:
        raise ValueError("suffix_decoding_max_spec_tokens is for method='hybrid' (suffix: num_speculative_tokens)")
    out = {k: spec.get(k, default) for k, default in SUFFIX_KEYS.items()}
    for k in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_tokens"):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= (256 if "depth" in k else MAX_SUFFIX_TOKENS):
            raise ValueError(f"{k} must be an int in [1, {256 if 'depth' in k else MAX_SUFFIX_TOKENS}], got {v!r}")
    v = out["suffix_decoding_max_cached_requests"]
    if isinstance(v, bool) or not isinstance(v, int) or v < -1:
        raise ValueError(f"suffix_decoding_max_cached_requests must be an int >= -1 (-1: unbounded), got {v!r}")
    for k in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "suffix_decoding_min_score"):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{k} must be a non-negative number, got {v!r}")
    if out["suffix_decoding_min_token_prob"] > 1:
        raise ValueError("suffix_decoding_min_token_prob must lie in [0, 1]")
    if not isinstance(out["suffix_decoding_use_tree_spec"], bool):
        raise ValueError("suffix_decoding_use_tree_spec must be a bool")
    return out


def is_eagle_head(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds an EAGLE head (an ``fc`` over the target's features) rather than a draft model."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as weights:
                names = list(weights.keys())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt weight file {f}: {e}") from None
        if any(k.split(".")[-2] == "fc" or k.startswith("midlayer.") for k in names if "." in k):
            return True
    return False
