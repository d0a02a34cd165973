"""Llama-family models (Llama, Mistral, Qwen2, Qwen3) loaded from HF directories."""

from spec_engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from spec_engine.models.llama import LlamaForCausalLM
from spec_engine.models.loader import load_model, save_model
from spec_engine.models.target import Target

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelConfig", "Target", "load_model", "save_model"]
