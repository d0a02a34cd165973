"""Drafters: anything that proposes token trees (a draft model, n-gram lookup; later EAGLE heads)."""

from spec_engine.drafters.base import Draft, Drafter, StepBatch
from spec_engine.drafters.draft_model import DraftModelDrafter
from spec_engine.drafters.ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "DraftModelDrafter", "NgramDrafter", "StepBatch"]
