"""The model families (Llama, Mistral, Qwen2, Qwen3, Phi-3 on the Llama layer; Gemma 2 and 3 on their own) loaded from
HF directories and GGUF files."""

from spec_engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from spec_engine.models.llama import LlamaForCausalLM
from spec_engine.models.loader import load_model, save_model
from spec_engine.models.target import Target

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelConfig", "Target", "load_model", "save_model"]
