"""Evaluation helpers shared by the stages."""
