"""spec_engine: a small speculative decoding engine on the spec_kernels ops.

from spec_engine import LLM, SamplingParams
llm = LLM(model=target_dir, speculative_config={"method": "draft_model", "model": draft_dir})
outs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=64))
"""

import importlib
import os

# A decoding step reads every weight from memory, many rows side by side: on 4 KiB pages that is a TLB miss every few
# KiB of each stream. PyTorch's CPU allocator backs allocations of 2 MiB and more with huge pages where this is set
# (THP in "madvise" mode, the common default); it reads it once, at the process's first allocation, so it is set
# here, before the engine allocates anything (bench/RESULTS.md, "8-bit activations"). Set it to 0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# Each public name imported on first use (PEP 562): the CLI's start-up imports no torch before its own argument parsing
# and Ctrl-C handling (`specdec --help` answers at once; a Ctrl-C while torch loads ends in one line, not a traceback).
_HOMES = {"LLM": "spec_engine.llm", "CompletionOutput": "spec_engine.llm", "RequestOutput": "spec_engine.llm",
          "SamplingParams": "spec_engine.sampling", "default_model_paths": "spec_engine.zoo"}  # fmt: skip

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:  # a submodule, as the package's eager imports once made them (`spec_engine.llm.LLM`)
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # (later lookups skip this function)
    return value
