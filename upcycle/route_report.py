"""The route's result table (``report.json``, ``report.md``, ``report.png``): perplexity on held-out real text of the teacher and of the hybrid after each
stage (init only, ILD, KD, DPO), DPO's held-out reward accuracy, and the tokens and minutes each stage used.

    upcycle report --route-dir runs/smollm2_route [--data data_cache/janeausten-smollm2] [--tokens 65536]

The held-out text is the validation split of the packed data that ILD trained on (whole documents that no
stage saw). "Init only" is the hybrid composed from the two un-distilled ``upcycle init`` students with the
layers SMART chose, so that the ILD row differs from it by training alone.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from hybridlm.config.errors import ConfigError
from hybridlm.data.packed import PackedTokens
from hybridlm.eval.perplexity import perplexity
from hybridlm.utils.atomic import atomic_write_text, json_text, write_json

STAGE_DIRS = (("ild_mla", "ILD (MLA student)"), ("ild_mamba2", "ILD (Mamba2 student)"),
              ("ild_gdn", "ILD (GDN student)"), ("ild_kda", "ILD (KDA student)"),
              ("kd", "KD-SFT"), ("dpo", "DPO"))


def heldout_windows(data_path, seq_len: int, max_tokens: int) -> List[torch.Tensor]:
    """Consecutive ``seq_len + 1`` token windows from the validation split, at most ``max_tokens`` targets."""
    tokens = PackedTokens(data_path, "val")
    n = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    if n < 1:
        raise ConfigError(f"{data_path}: the validation split has fewer than {seq_len + 1} tokens")
    stream = np.asarray(tokens.read(0, n * seq_len + 1), dtype=np.int64)
    return [torch.from_numpy(stream[i * seq_len:(i + 1) * seq_len + 1].copy()) for i in range(n)]


def _stage_row(out: Path, name: str, label: str) -> Optional[Dict[str, Any]]:
    done = out / name / "final" / "stage.json"
    if not done.is_file():
        return None
    s = json.loads(done.read_text())
    row = {"stage": label, "steps": s.get("steps"), "tokens": s.get("tokens"),
           "minutes": round(s["seconds"] / 60.0, 2) if s.get("seconds") is not None else None}
    if s.get("eval"):
        row["dpo_heldout"] = s["eval"]
    return row


@torch.no_grad()
def route_report(route_dir, data_path, seq_len: int = 512, max_tokens: int = 65536,
                 device: Optional[torch.device] = None) -> Dict[str, Any]:
    """Measure every model the route has written so far; write ``report.json`` and ``report.md`` there."""
    from hybridlm.model import HybridForCausalLM
    from upcycle.compose import compose_from_dirs
    from upcycle.smart_stage import layers_from_report
    from upcycle.teacher import load_teacher

    out = Path(route_dir)
    route_cfg = out / "route_config.json"
    if not route_cfg.is_file():
        raise ConfigError(f"{route_cfg}: missing (expected a directory written by `upcycle run`)")
    cfg = json.loads(route_cfg.read_text())
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    windows = heldout_windows(data_path, seq_len, max_tokens)
    linear = (cfg.get("init") or {}).get("linear_mixer", "mamba2")

    models: List[tuple] = [("teacher", lambda: load_teacher(cfg.get("teacher") or "asset:smollm2"))]
    if (out / "smart" / "smart_report.json").is_file():
        chosen, _ = layers_from_report(out / "smart")
        init_hybrid = out / "hybrid_init"
        if not (init_hybrid / "config.json").is_file():
            compose_from_dirs(out / "init" / "mla_student", out / "init" / f"{linear}_student", chosen, init_hybrid,
                              overwrite=True)
        models.append(("hybrid, init only", lambda: HybridForCausalLM.from_pretrained(init_hybrid)))
    for label, path in (("hybrid after ILD", out / "hybrid"), ("after KD-SFT", out / "kd" / "final"),
                        ("after DPO", out / "dpo" / "final")):
        if (path / "config.json").is_file():
            models.append((label, lambda p=path: HybridForCausalLM.from_pretrained(p)))

    rows = []
    for label, load in models:
        model = load().to(device=device, dtype=torch.float32)
        rows.append({"model": label, **perplexity(model, windows)})
        print(json_text(rows[-1]), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    stages = [r for r in (_stage_row(out, n, lbl) for n, lbl in STAGE_DIRS) if r is not None]
    report = {"heldout": {"data": str(data_path), "split": "val", "seq_len": seq_len,
                          "tokens": sum(w.numel() - 1 for w in windows)},
              "perplexity": rows, "stages": stages}
    write_json(out / "report.json", report)
    atomic_write_text(str(out / "report.md"), report_markdown(report))
    plot_report(report, out / "report.png")
    print(f"route report: {out / 'report.md'}", flush=True)
    return report


def plot_report(report: Dict[str, Any], png: Path) -> Path:
    """Held-out perplexity of the teacher and of the hybrid after each stage (log scale), one bar each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["perplexity"]
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 2, 4))
    colors = ["#444444"] + ["#1f77b4"] * (len(rows) - 1)
    bars = ax.bar([r["model"].replace(", ", ",\n").replace(" after ", "\nafter ") for r in rows],
                  [r["ppl"] for r in rows], color=colors)
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['ppl']:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("perplexity (held-out, log scale)")
    ax.set_title(f"{report['heldout']['tokens']:,} held-out tokens")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    tmp = png.with_name(png.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(png)  # atomic, like the JSON and Markdown beside it
    return png


def report_markdown(report: Dict[str, Any]) -> str:
    h = report["heldout"]
    lines = [f"Perplexity on {h['tokens']:,} held-out tokens ({h['data']}, {h['split']} split, windows of {h['seq_len']}):",
             "", "| model | perplexity | NLL (nats/token) |", "|---|---|---|"]
    lines += [f"| {r['model']} | {r['ppl']:.2f} | {r['nll']:.4f} |" for r in report["perplexity"]]
    lines += ["", "| stage | steps | tokens | minutes | held-out DPO reward accuracy |", "|---|---|---|---|---|"]
    for s in report["stages"]:
        acc = s.get("dpo_heldout", {}).get("rewards/accuracies")
        lines.append(f"| {s['stage']} | {s['steps']} | {s['tokens']:,} | {s['minutes']} | "
                     f"{'' if acc is None else f'{acc:.3f}'} |")
    return "\n".join(lines) + "\n"
