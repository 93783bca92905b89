"""Evaluation code shared by the stages."""
