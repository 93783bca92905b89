"""Upcycling a pretrained Llama into an MLA + Mamba2 hybrid (``upcycle`` CLI)."""
