"""Distillation and preference stages of the upcycled hybrid: DPO loss and preference data."""
from .dpo import METRIC_KEYS, dpo_loss, sequence_logps
from .preference_data import (PreferencePair, collate_pairs, load_preference_data, normalize_record, render_prompt,
                              render_texts, tokenize_pair)

__all__ = ["dpo_loss", "sequence_logps", "METRIC_KEYS", "PreferencePair", "load_preference_data",
           "normalize_record", "render_prompt", "render_texts", "tokenize_pair", "collate_pairs"]
