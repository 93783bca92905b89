"""KD-SFT: the student learns the frozen teacher's next-token distribution on chat data or general text.

Loss over the supervised (assistant) tokens, shifted like a causal LM (the logits at position t score
``labels[t + 1]``; positions whose target is -100 are left out)::

    loss = kl_weight * mean_t KL(p_teacher(. | <t) || p_student(. | <t)) + ce_weight * mean_t CE(student, label)

with both distributions softened by ``temperature`` inside the KL (the CE always at temperature 1). The KL
is a per-token mean in nats (the published code sums over the tokens of each sequence, so its loss starts
near 20,000); no T^2 factor is applied (fold one into ``kl_weight`` if wanted). Published settings: kl 1.0,
ce 0.0, temperature 1, lr 8e-5 cosine with 1% warmup, bf16, seq 2048; every student parameter trains
(end-to-end; embeddings and the tied LM head included).

Memory: the KL never materialises ``[tokens, vocab]`` logits. :class:`ChunkedLinearKD` takes the final
hidden states of both models and their LM-head weights, walks the supervised tokens in chunks of
``chunk_tokens`` and computes, per chunk, both models' logits, the KL / CE sums and the gradient with
respect to the student's logits, which it folds straight into the hidden-state and weight gradients (the
same trick as :mod:`hybridlm.model.loss`'s chunked cross-entropy). At most one chunk of logits exists at a
time, on CPU and GPU alike; the result does not depend on the chunk size beyond float summation order, so
there is one exact path (fla's ``FusedKLDivLoss`` would be a second, GPU-only one; it is not used).

CLI (wired into ``python -m upcycle.cli`` by :func:`add_subcommands`)::

    upcycle kd --config configs/upcycle/smollm2_kd_cpu.yaml student.path=... run.output_dir=...
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from hybridlm.config.errors import ConfigError
from hybridlm.utils.atomic import write_json

IGNORE_INDEX = -100
KD_SECTIONS = ("teacher", "student", "data", "optim", "run", "kd")


# ------------------------------------------------------------------------------------- config
@dataclass
class KDConfig:
    """The ``kd:`` section: loss weights, softmax temperature and the KL chunk size (tokens)."""

    kl_weight: float = 1.0
    ce_weight: float = 0.0
    temperature: float = 1.0
    chunk_tokens: int = 1024  # supervised tokens per logits chunk (memory: ~3 x chunk x vocab fp32)

    def validate(self, where: str = "kd") -> None:
        for name in ("kl_weight", "ce_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ConfigError(f"{where}.{name}: expected a finite number >= 0, got {v!r}")
        if self.kl_weight == 0 and self.ce_weight == 0:
            raise ConfigError(f"{where}: kl_weight and ce_weight are both 0 (nothing to train on)")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ConfigError(f"{where}.temperature: expected a number > 0, got {t!r}")
        c = self.chunk_tokens
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ConfigError(f"{where}.chunk_tokens: expected an integer >= 1, got {c!r}")


# ------------------------------------------------------------------------------------- loss
class ChunkedLinearKD(torch.autograd.Function):
    """``kl_weight * mean KL(softmax(t/T) || softmax(s/T)) + ce_weight * mean CE(s, y)`` over N rows with
    ``s = hs @ ws.T``, ``t = ht @ wt.T``, computed chunk by chunk; gradients flow to ``hs`` and ``ws`` only.

    Returns ``(loss, kl, ce)``; ``kl`` and ``ce`` are the unweighted token means (non-differentiable)."""

    @staticmethod
    def forward(ctx, hs, ws, ht, wt, targets, temperature: float, kl_weight: float, ce_weight: float,
                chunk_tokens: int):
        n = hs.shape[0]
        denom = max(n, 1)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hs) if need_grad else None
        grad_w = torch.zeros_like(ws, dtype=torch.float32) if need_grad else None
        kl_sum = torch.zeros((), dtype=torch.float32, device=hs.device)
        ce_sum = torch.zeros((), dtype=torch.float32, device=hs.device)
        inv_t = 1.0 / float(temperature)
        for lo in range(0, n, chunk_tokens):
            h, y = hs[lo:lo + chunk_tokens], targets[lo:lo + chunk_tokens]
            s = (h @ ws.t()).float()
            with torch.no_grad():
                log_pt = F.log_softmax((ht[lo:lo + chunk_tokens] @ wt.t()).float() * inv_t, dim=-1)
            log_ps = F.log_softmax(s * inv_t, dim=-1) if inv_t != 1.0 else None
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            if log_ps is None:
                log_ps = s - lse
            pt = log_pt.exp()
            kl_sum += (pt * (log_pt - log_ps)).sum()
            ce_sum += (lse.squeeze(-1) - s.gather(-1, y.unsqueeze(-1)).squeeze(-1)).sum()
            if need_grad:
                # d/ds: kl_weight (softmax(s/T) - p_t) / T / n  +  ce_weight (softmax(s) - onehot(y)) / n
                g = log_ps.exp_().sub_(pt).mul_(kl_weight * inv_t / denom)
                if ce_weight:
                    p1 = s.sub_(lse).exp_()
                    p1.scatter_add_(-1, y.unsqueeze(-1), -torch.ones_like(y, dtype=p1.dtype).unsqueeze(-1))
                    g.add_(p1, alpha=ce_weight / denom)
                grad_h[lo:lo + chunk_tokens] = (g.to(ws.dtype) @ ws).to(hs.dtype)
                grad_w.addmm_(g.t(), h.float())
            del s, log_pt, log_ps, pt, lse
        kl, ce = kl_sum / denom, ce_sum / denom
        loss = kl_weight * kl + ce_weight * ce
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = ws.dtype
        ctx.mark_non_differentiable(kl, ce)
        return loss, kl, ce

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_ce):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_loss.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_loss).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None, None


@torch.no_grad()
def kl_sum(hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor, chunk_tokens: int = 1024) -> float:
    """Summed KL(softmax(ht wt^T) || softmax(hs ws^T)) over the rows (nats), through the same chunked loop as
    the KD loss: one chunk of both models' logits at a time, neither model's full log-probabilities ever."""
    if hs.shape[0] != ht.shape[0]:
        raise ValueError(f"kl: {hs.shape[0]} student rows vs {ht.shape[0]} teacher rows")
    if hs.shape[0] == 0:
        return 0.0
    zeros = torch.zeros(hs.shape[0], dtype=torch.long, device=hs.device)  # no CE: its weight is 0
    _, kl, _ = ChunkedLinearKD.apply(hs, ws.detach(), ht.to(hs.device), wt.detach().to(hs.device), zeros, 1.0,
                                     1.0, 0.0, int(chunk_tokens))
    return float(kl) * hs.shape[0]


def final_hidden(model, input_ids: torch.LongTensor) -> torch.Tensor:
    """Last-layer (final-norm) hidden states ``(B, T, d)`` of a HybridForCausalLM or a transformers causal LM."""
    from hybridlm.model import HybridForCausalLM
    if isinstance(model, HybridForCausalLM):
        return model.model(input_ids=input_ids)
    out = model.model(input_ids=input_ids, use_cache=False)
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


def kd_loss(student, teacher, batch: Dict[str, torch.Tensor], kl_weight: float = 1.0, ce_weight: float = 0.0,
            temperature: float = 1.0, chunk_tokens: int = 1024) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """KD loss of one batch (``input_ids``, ``labels`` aligned with them, -100 = not supervised).

    The teacher runs in its own dtype under ``no_grad``. Metrics: ``kl`` (nats / supervised token, at
    ``temperature``), ``ce`` (the student's cross-entropy on the labels, nats / token), ``tokens`` (the
    number of supervised tokens, so that validation averages are exact token means)."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(-1)
    with torch.no_grad():
        t_hidden = final_hidden(teacher, input_ids)
        ht = t_hidden.reshape(-1, t_hidden.shape[-1]).index_select(0, rows)
    s_hidden = final_hidden(student, input_ids)
    hs = s_hidden.reshape(-1, s_hidden.shape[-1]).index_select(0, rows)
    ws, wt = student.get_output_embeddings().weight, teacher.get_output_embeddings().weight
    if ws.shape[0] != wt.shape[0]:
        raise ConfigError(f"kd: student vocabulary {ws.shape[0]} differs from the teacher's {wt.shape[0]}")
    loss, kl, ce = ChunkedLinearKD.apply(hs, ws, ht, wt.detach(), targets.index_select(0, rows), float(temperature),
                                         float(kl_weight), float(ce_weight), int(chunk_tokens))
    return loss, {"kl": kl, "ce": ce, "tokens": rows.numel()}


# ------------------------------------------------------------------------------------- data
KD_DATA_FORMATS = ("chat", "packed")


class AlignedLabels:
    """Packed LM batches (labels = the next tokens) as KD batches (labels aligned with ``input_ids``, every
    token supervised); the wrapped iterator's resume state passes through."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        return aligned_labels(next(self.batches))

    def state_dict(self):
        return self.batches.state_dict()

    def load_state_dict(self, state):
        self.batches.load_state_dict(state)

    def __getattr__(self, name):  # epoch sizes and the like, for the loop's progress line
        return getattr(self.batches, name)


def aligned_labels(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    # kd_loss scores labels[t + 1] at position t, so the window's own ids are its aligned labels (the window's
    # last target is dropped: one token in seq_len)
    return {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}


def packed_kd_batches(data_cfg, optim, dist, tokenizer):
    from upcycle.stage import packed_lm_batches
    train, val = packed_lm_batches(data_cfg, optim, dist, tokenizer)
    return AlignedLabels(train), [aligned_labels(b) for b in val]


def kd_data(data_section: Optional[Dict[str, Any]]) -> Tuple[type, Any, Dict[str, Any]]:
    """(dataclass, batch factory, section without ``format``) of a KD ``data:`` section.

    ``format: chat`` (default): a chat / alpaca JSON file, the assistant tokens supervised. ``format: packed``:
    text sources packed into windows exactly like ILD's data (a :class:`hybridlm.data.DataConfig`), every token
    supervised: KD on general text keeps what the teacher knows beyond chat."""
    from hybridlm.data import DataConfig
    from hybridlm.data.sft import SFTDataConfig, make_sft_batches
    section = dict(data_section or {})
    fmt = section.pop("format", "chat")
    if fmt not in KD_DATA_FORMATS:
        raise ConfigError(f"kd.data.format: {fmt!r} is not one of {', '.join(KD_DATA_FORMATS)}")
    if fmt == "packed":
        return DataConfig, packed_kd_batches, section
    return SFTDataConfig, make_sft_batches, section


# ------------------------------------------------------------------------------------- stage
def amend_stage_result(output_dir, extra: Dict[str, Any], config_extra: Optional[Dict[str, Any]] = None,
                       result: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Add keys to ``output_dir/final/stage.json`` (rank 0 writes, atomically) and to ``result``.

    ``config_extra`` goes under ``result["config"]`` and is only added when absent, so a skipped (already
    finished) stage keeps recording the settings it actually ran with."""
    from hybridlm.engine import barrier, is_main
    done = Path(output_dir) / "final" / "stage.json"
    result = dict(result or {})
    changed = False
    for k, v in (config_extra or {}).items():
        cfg = result.setdefault("config", {})
        if k not in cfg:
            cfg[k] = v
            changed = True
    for k, v in extra.items():
        if result.get(k) != v:
            result[k] = v
            changed = True
    if changed and is_main() and done.is_file():
        write_json(done, result)
    barrier()
    return result


def run_kd(sections: Dict[str, Any]) -> Dict[str, Any]:
    """KD-SFT of the student directory on chat data (``kd:`` section: :class:`KDConfig`); every student
    parameter trains. Returns (and writes to ``final/stage.json``) the stage summary."""
    from hybridlm.config.structured import build_dataclass, to_dict
    from hybridlm.training import RunConfig
    from upcycle.stage import run_stage

    sections = dict(sections)
    cfg = build_dataclass(KDConfig, sections.pop("kd", None) or {}, "kd")
    data_class, make_batches, sections["data"] = kd_data(sections.get("data"))

    def make_loss(teacher):
        teacher.eval()
        return lambda student, batch: kd_loss(student, teacher, batch, cfg.kl_weight, cfg.ce_weight,
                                              cfg.temperature, cfg.chunk_tokens)

    result = run_stage("kd", sections, make_loss, lambda student: student.parameters(),
                       make_batches=make_batches, data_class=data_class)
    run = build_dataclass(RunConfig, sections["run"], "run")
    return amend_stage_result(run.output_dir, {}, {"kd": to_dict(cfg)}, result)


# ------------------------------------------------------------------------------------- CLI
def cmd_kd(args) -> Dict[str, Any]:
    from hybridlm.config.loader import load_config
    return run_kd(load_config(args.config, args.overrides, sections=KD_SECTIONS))


def add_stage_parser(subparsers, name: str, help: str, sections_help: str, fn) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help)
    p.add_argument("--config", required=True, help=f"stage YAML: {sections_help} sections")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. student.path=... optim.lr=1e-4")
    p.set_defaults(fn=fn)
    return p


def add_subcommands(subparsers) -> None:
    """Register ``kd`` on an argparse subparsers object (``upcycle kd --config FILE [section.key=value ...]``)."""
    add_stage_parser(subparsers, "kd", "KD-SFT: the student learns the frozen teacher's token distribution "
                     "on chat data (all student parameters train)", ", ".join(KD_SECTIONS), cmd_kd)
