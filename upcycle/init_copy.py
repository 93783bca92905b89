"""Copying a teacher's weights into a student's parameters: shape checks, GQA row expansion, dtype-keeping copies."""
from __future__ import annotations

import torch


def repeat_kv_rows(w: torch.Tensor, n_kv: int, n_h: int) -> torch.Tensor:
    """``[n_kv d_h, d]`` -> ``[n_h d_h, d]``: kv head j becomes query heads j*g .. j*g+g-1 (g = n_h / n_kv)."""
    d_h = w.shape[0] // n_kv
    return w.reshape(n_kv, d_h, w.shape[1]).repeat_interleave(n_h // n_kv, dim=0).reshape(n_h * d_h, w.shape[1])


def expect(kind: str, what: str, got, want) -> None:
    """ValueError unless a student mixer's ``what`` is what the teacher's attention needs."""
    if got != want:
        raise ValueError(f"{kind} init from attention: {what} is {got}, the teacher needs {want} "
                         f"(build the student with upcycle.student.student_config)")


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst <- src`` in ``dst``'s device and dtype."""
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def copy_same(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """``dst <- src`` after checking that the shapes agree (ValueError naming ``what`` otherwise)."""
    if dst.shape != src.shape:
        raise ValueError(f"{what}: student shape {tuple(dst.shape)} vs teacher {tuple(src.shape)}")
    copy_into(dst, src.detach())
