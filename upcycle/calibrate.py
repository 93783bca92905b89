"""Output-scale calibration of attention-initialised linear mixers (Mamba2, GDN, KDA).

A linear mixer copied from attention ends in a (gated) RMSNorm: it hands the teacher's ``W_o`` a signal of unit
RMS per group, while ``W_o`` was trained on attention outputs that are often ten times smaller. So each layer's
output-norm weight ``w`` is fitted by least squares, teacher-forced: with ``n`` the mixer's normalised output
(weight 1) and ``a`` the teacher attention's output on the same input,

    minimise  sum_tokens || W_o (w[idx] * n) - a ||^2  +  ridge ||w||^2

(``idx`` maps channels to weights: one weight per channel; with ``per_channel=False`` on GDN / KDA, one per head
channel shared by the heads). Mamba2's norm weight has one entry per channel and takes ``w``; GDN / KDA share
theirs across heads, so their per-channel ``w`` is folded into ``W_o``'s columns (the norm weight stays 1). The
normal equations are ``(P^T ((n^T n) * (W_o^T W_o)) P) w = P^T ((a W_o) * n).sum(0)`` with ``P`` the
channel-to-weight one-hot matrix, a small dense solve per layer. On the calibration tokens the fit is
never worse than a silent mixer (w = 0). docs/upcycling_init.md has the measurements.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from distill.ild import teacher_trace
from hybridlm.config.errors import ConfigError
from hybridlm.data.assets import resolve_source
from hybridlm.data.packed import PackedTokens
from hybridlm.eval.perplexity import token_windows
from hybridlm.model.registry import linear_kinds


def calibration_text(sources: Sequence[str], max_chars: int) -> List[str]:
    """Plain text of ``sources`` (``asset:<name>``, a ``.txt`` file or a directory of them), documents taken
    round-robin across sources until ``max_chars`` characters."""
    per_source: List[List[Path]] = []
    for spec in sources:
        path = Path(resolve_source(spec))
        files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise ConfigError(f"init.calib_sources: {spec!r} holds no .txt documents")
        per_source.append(files)
    texts, total, i = [], 0, 0
    while total < max_chars and any(i < len(f) for f in per_source):
        for files in per_source:
            if i < len(files) and total < max_chars:
                text = files[i].read_text(encoding="utf-8", errors="replace")
                texts.append(text[:max_chars - total])
                total += len(texts[-1])
        i += 1
    return texts


def packed_windows(path: Path, tokens: int, seq_len: int) -> List[torch.Tensor]:
    """``seq_len + 1`` windows spread evenly over the training split of a prepared dataset (``prepare``'s
    output: its documents come source by source, so even spacing samples every source)."""
    split = PackedTokens(path, "train")
    n = max(1, tokens // seq_len)
    last = len(split) - seq_len - 1
    if last < 0:
        raise ConfigError(f"init.calib_sources: {path} has fewer than {seq_len + 1} training tokens")
    starts = np.linspace(0, last, n).astype(np.int64)
    return [torch.from_numpy(np.asarray(split.read(int(s), seq_len + 1), dtype=np.int64)) for s in starts]


def calibration_batch(tokenizer, sources: Sequence[str], tokens: int, seq_len: int) -> torch.Tensor:
    """``[n, seq_len]`` token ids of the calibration text (at least one window). A source that is a prepared
    dataset (a directory with ``meta.json``, tokenized by the teacher's tokenizer) gives windows of its
    training split; the others are plain text."""
    packed = [Path(s) for s in sources if (Path(s) / "meta.json").is_file()]
    text = [s for s in sources if not (Path(s) / "meta.json").is_file()]
    windows = [w for p in packed for w in packed_windows(p, tokens // len(sources), seq_len)]
    if text:
        windows += token_windows(tokenizer, calibration_text(text, 8 * tokens), seq_len,
                                 tokens * len(text) // len(sources))
    if not windows:
        raise ConfigError(f"init.calib_sources: fewer than {seq_len + 1} tokens of text in {list(sources)}")
    return torch.stack(windows)[:, :-1]


def _norm_weight(mixer) -> torch.nn.Parameter:
    """The output norm's weight (Mamba2's ``norm_weight``, GDN / KDA's ``o_norm_weight``)."""
    for name in ("norm_weight", "o_norm_weight"):
        if hasattr(mixer, name):
            return getattr(mixer, name)
    raise ConfigError(f"init.calib_tokens: a {type(mixer).__name__} mixer has no output norm (norm_weight or "
                      f"o_norm_weight) whose scale calibration fits; set init.calib_tokens: 0 to skip calibration")


def _out_proj(mixer) -> torch.nn.Linear:
    return mixer.out_proj if hasattr(mixer, "out_proj") else mixer.o_proj


@torch.no_grad()
def fit_output_scale(mixer, x: torch.Tensor, target: torch.Tensor, ridge: float = 1e-3,
                     per_channel: Optional[bool] = None) -> Dict[str, float]:
    """Set ``mixer``'s output scale to the least-squares fit of ``mixer(x) ~ target``; returns the relative squared
    error before and after (``target`` [B, T, d] is the teacher attention's output).

    ``per_channel`` (default: where the norm weight is shared by the heads, GDN / KDA): one weight per channel
    of every head, folded into the out projection's columns (the norm weight set to 1), since the per-head norm
    erases the teacher's head-to-head scale that one shared weight cannot restore. False: the norm weight
    itself (Mamba2's has one entry per channel already)."""
    weight, out_proj = _norm_weight(mixer), _out_proj(mixer)
    channels = out_proj.in_features
    if per_channel is None:
        per_channel = weight.numel() < channels
    width = channels if per_channel else weight.numel()
    target = target.to(torch.float64).reshape(-1, target.shape[-1])
    before = (mixer(x).to(torch.float64).reshape(target.shape) - target).pow(2).sum() / target.pow(2).sum()
    weight.fill_(1.0)
    captured = {}
    hook = out_proj.register_forward_pre_hook(lambda _m, args: captured.__setitem__("n", args[0]))
    try:
        mixer(x)
    finally:
        hook.remove()
    n = captured["n"].reshape(-1, out_proj.in_features).to(torch.float64)
    w_o = out_proj.weight.to(torch.float64)
    onehot = torch.zeros(channels, width, dtype=torch.float64, device=n.device)
    onehot[torch.arange(channels), torch.arange(channels) % width] = 1.0  # shared: heads share o_norm_weight
    gram = onehot.T @ ((n.T @ n) * (w_o.T @ w_o)) @ onehot
    rhs = onehot.T @ ((target @ w_o) * n).sum(0)
    gram += ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    w = torch.linalg.solve(gram, rhs)
    if width == weight.numel():
        weight.copy_(w.to(weight.dtype))
    else:  # W_o (w * n) = (W_o diag(w)) n with the norm weight at 1
        out_proj.weight.copy_((w_o * w).to(out_proj.weight.dtype))
    after = (mixer(x).to(torch.float64).reshape(target.shape) - target).pow(2).sum() / target.pow(2).sum()
    return {"rel_err_before": float(before), "rel_err_after": float(after)}


@torch.no_grad()
def calibrate_student(student, teacher, input_ids: torch.Tensor, layer_kinds: Sequence[str],
                      linear: Optional[Sequence[str]] = None,
                      progress: bool = True) -> Dict[int, Dict[str, float]]:
    """Fit every linear mixer's output scale of ``student`` (layer ``i`` = sublayers ``2i, 2i + 1``) to the
    teacher's attention output on ``input_ids``, each layer fed the teacher's own input (teacher-forced); ``linear``:
    the kinds to fit (default: the registry's linear mixers).
    Minutes on a CPU for a 30-layer teacher: ``progress`` shows a bar over the layers."""

    if progress:
        print(f"calibrating the linear mixers on {input_ids.numel()} tokens: the teacher's forward, then one fit "
              f"per layer", flush=True)
    trace = teacher_trace(teacher, input_ids.to(next(teacher.parameters()).device))
    report = {}
    linear = set(linear_kinds() if linear is None else linear)  # default: every linear mixer of the registry
    layers = [i for i, kind in enumerate(layer_kinds) if kind in linear]
    for i in tqdm(layers, desc="calibrate", unit="layer", disable=not progress, dynamic_ncols=True):
        block = student.model.layers[2 * i]
        x, attn_out, _ = trace[i]
        dtype = next(block.parameters()).dtype
        report[i] = fit_output_scale(block.mixer, block.norm(x.to(dtype)), attn_out)
    return report
