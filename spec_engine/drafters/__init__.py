"""Drafters: anything that proposes token trees (a draft model, an EAGLE head, suffix decoding, the hybrid, n-gram
lookup). ``factory.DrafterFactory`` builds them from a speculative config."""

from spec_engine.drafters.base import Draft, Drafter, StepBatch
from spec_engine.drafters.draft_model import DraftModelDrafter
from spec_engine.drafters.ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "DraftModelDrafter", "NgramDrafter", "StepBatch"]
