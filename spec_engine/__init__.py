"""spec_engine: a small speculative decoding engine on the spec_kernels ops.

from spec_engine import LLM, SamplingParams
llm = LLM(model=target_dir, speculative_config={"method": "draft_model", "model": draft_dir})
outs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=64))
"""

from spec_engine.llm import LLM, CompletionOutput, RequestOutput
from spec_engine.sampling import SamplingParams
from spec_engine.zoo import default_model_paths

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "default_model_paths"]
