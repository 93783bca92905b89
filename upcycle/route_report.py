"""The route's result table (``report.json``, ``report.md``, ``report.png``): for the teacher and the hybrid after
each stage (init only, ILD, KD, long-context KD, DPO), perplexity and per-token KL(teacher || model) on two held-out
texts, DPO's held-out reward accuracy, the ``austen_cloze`` accuracy of each model (``report.cloze_items``),
generation scores of each model's greedy continuations of held-out prompts (``report.generation_prompts``;
:mod:`hybridlm.eval.generation_score`), the RULER-style long-context scores of each model at
``report.ruler_lengths`` (:mod:`hybridlm.eval.ruler`; also ``ruler.json``, ``ruler.md``, ``ruler.png``), and the
tokens and minutes each stage used.

    upcycle report --route-dir runs/smollm2_route [--data data_cache/mix-smollm2] [--tokens 65536]

Held-out text (a) is the validation split of the packed data that ILD trained on (whole documents that no stage
saw); (b) is ``report.heldout_sources`` (e.g. ``asset:sotu``), a source that no stage trains on. Perplexity is
``exp`` of the token-mean next-token NLL; KL is the token mean of ``sum_v p_t(v) (log p_t(v) - log p_m(v))`` in
nats, both over the same targets (every token of each window but its first), computed by the KD loss's chunked
loop (:func:`distill.kd_loss.kd_loss`), so no ``[tokens, vocab]`` tensor is kept. "Init only" is the hybrid composed from the two un-distilled ``upcycle init`` students with the
layers SMART chose, so that the ILD row differs from it by training alone.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from distill.kd_loss import kd_loss
from distill.teacher_samples import MANIFEST as SAMPLES_MANIFEST
from hybridlm.config.errors import ConfigError
from hybridlm.data.assets import corpus_path
from hybridlm.data.packed import heldout_windows
from hybridlm.eval.build_tasks import austen_cloze_items
from hybridlm.eval.generation_score import GenerationScorer, NGRAM, PROMPT_SOURCE, check_prompt_source_heldout, heldout_prompts
from hybridlm.eval.multiple_choice import multiple_choice_accuracy
from hybridlm.eval.perplexity import token_windows
from hybridlm.eval.ruler import evaluate_model, load_haystack, resolve_tasks, ruler_result, write_ruler_outputs
from hybridlm.eval.ruler.haystack import DEFAULT_HAYSTACK
from hybridlm.model import HybridForCausalLM
from hybridlm.teacher import load_teacher, load_teacher_tokenizer
from hybridlm.utils.atomic import atomic_write_text, json_text, save_figure, write_json
from smart_select.report import layers_from_report
from upcycle.calibrate import calibration_text
from upcycle.compose import compose_from_dirs
from upcycle.init_students import InitConfig

STAGE_DIRS = (("ild_mla", "ILD (MLA student)"), ("ild_mamba2", "ILD (Mamba2 student)"),
              ("ild_gdn", "ILD (GDN student)"), ("ild_kda", "ILD (KDA student)"),
              ("align", "Alignment"), ("kd", "KD-SFT"), ("long_context", "Long-context KD"), ("dpo", "DPO"))


def _stage_row(out: Path, name: str, label: str) -> Optional[Dict[str, Any]]:
    done = out / name / "final" / "stage.json"
    if not done.is_file():
        return None
    s = json.loads(done.read_text())
    row = {"stage": label, "steps": s.get("steps"), "max_steps": ((s.get("config") or {}).get("optim") or {}).get("max_steps"), "tokens": s.get("tokens"),
           "minutes": round(s["seconds"] / 60.0, 2) if s.get("seconds") is not None else None}
    if s.get("eval"):
        row["dpo_heldout"] = s["eval"]
    return row


def text_windows(tokenizer, sources, seq_len: int, max_tokens: int) -> List[torch.Tensor]:
    """``seq_len + 1`` token windows of the plain text of ``sources`` (held-out text (b))."""
    windows = token_windows(tokenizer, calibration_text(list(sources), 16 * max_tokens), seq_len, max_tokens)
    if not windows:
        raise ConfigError(f"report.heldout_sources: fewer than {seq_len + 1} tokens in {list(sources)}")
    return windows


@torch.no_grad()
def score(model, teacher, windows: List[torch.Tensor], batch_size: int = 4) -> Dict[str, float]:
    """Token-mean NLL, perplexity and KL(teacher || model) over the windows (targets = window[1:])."""
    device = next(model.parameters()).device
    nll = kl = 0.0
    count = 0
    for i in range(0, len(windows), batch_size):
        ids = torch.stack(windows[i:i + batch_size]).to(device)
        _, m = kd_loss(model, teacher, {"input_ids": ids, "labels": ids}, kl_weight=1.0, ce_weight=1.0)
        nll += float(m["ce"]) * m["tokens"]
        kl += float(m["kl"]) * m["tokens"]
        count += m["tokens"]
    nll, kl = nll / max(count, 1), kl / max(count, 1)
    return {"nll": nll, "ppl": math.exp(min(nll, 50.0)), "kl": kl, "tokens": count}


def ruler_options(lengths, items=5, tasks=("all",)):
    """``report.ruler_lengths`` / ``ruler_items`` / ``ruler_tasks`` checked: (sorted lengths, items, task names)."""
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        lengths = [lengths]
    if (not isinstance(lengths, (list, tuple)) or not lengths
            or not all(isinstance(L, int) and not isinstance(L, bool) and L >= 64 for L in lengths)):
        raise ConfigError(f"report.ruler_lengths: expected context lengths of at least 64 tokens, got {lengths!r}")
    if isinstance(items, bool) or not isinstance(items, int) or items < 1:
        raise ConfigError(f"report.ruler_items: expected a positive integer, got {items!r}")
    if not isinstance(tasks, (str, list, tuple)):
        raise ConfigError(f"report.ruler_tasks: expected task names, got {tasks!r}")
    names = resolve_tasks([tasks] if isinstance(tasks, str) else [str(t) for t in tasks], "report.ruler_tasks")
    return sorted(set(lengths)), items, names


class RulerScorer:
    """The report's RULER-style scores: every model on the same tasks, lengths and items (built with the teacher's
    tokenizer, which the hybrids keep); ``write`` saves the per-task table and plot of all of them."""

    def __init__(self, lengths, items: int, tasks):
        self.lengths, self.items, self.tasks = ruler_options(lengths, items, tasks)
        self.hay = load_haystack([DEFAULT_HAYSTACK])
        self.models: List[Dict[str, Any]] = []

    def __call__(self, model, tokenizer, label: str) -> Dict[str, float]:
        r = evaluate_model(model, tokenizer, label, self.tasks, self.lengths, self.items, self.hay)
        self.models.append(r)
        return {f"ruler_{L}": r["average"][str(L)] for L in self.lengths}

    def write(self, json_path: Path) -> Dict[str, Any]:
        result = ruler_result(self.models, self.tasks, self.lengths, self.items, self.hay, seed=0)
        files = write_ruler_outputs(result, json_path)
        return {"tasks": self.tasks, "lengths": self.lengths, "items": self.items, "haystack": self.hay.source,
                "files": files}


@torch.no_grad()
def route_report(route_dir, data_path, seq_len: int = 512, max_tokens: int = 65536,
                 device: Optional[torch.device] = None, heldout_sources=(), targets=(1.25, 1.10),
                 cloze_items: int = 0, generation_prompts: int = 0, generation_tokens: int = 64,
                 generation_prompt_tokens: int = 32, ruler_lengths=(), ruler_items: int = 5,
                 ruler_tasks=("all",)) -> Dict[str, Any]:
    """Measure every model the route has written so far; write ``report.json``, ``report.md`` and ``report.png``.
    ``cloze_items`` > 0 adds the ``austen_cloze`` accuracy (that many items) of every model; ``generation_prompts``
    > 0 adds the generation scores (``gen_ppl``, ``gen_ppl_ratio``, ``gen_repeat4``, ``gen_agree``) of greedy
    continuations of ``generation_tokens`` tokens after that many held-out prompts of ``generation_prompt_tokens``
    tokens (:mod:`hybridlm.eval.generation_score`); ``ruler_lengths`` adds the mean RULER-style score of every model
    at each of those lengths over ``ruler_items`` items of each of ``ruler_tasks`` (``ruler.*`` files beside)."""

    out = Path(route_dir)
    route_cfg = out / "route_config.json"
    if not route_cfg.is_file():
        raise ConfigError(f"{route_cfg}: missing (expected a directory written by `upcycle run`)")
    cfg = json.loads(route_cfg.read_text())
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher_spec = cfg.get("teacher") or "asset:smollm2"
    texts = {"a": {"name": f"{data_path} (validation split)", "windows": heldout_windows(data_path, seq_len, max_tokens)}}
    ruler = RulerScorer(ruler_lengths, ruler_items, ruler_tasks) if ruler_lengths else None
    tokenizer = (load_teacher_tokenizer(teacher_spec)
                 if heldout_sources or cloze_items or generation_prompts or ruler else None)
    if heldout_sources:
        if isinstance(heldout_sources, str):
            heldout_sources = [heldout_sources]
        texts["b"] = {"name": ", ".join(heldout_sources),
                      "windows": text_windows(tokenizer, heldout_sources, seq_len, max_tokens)}
    cloze = austen_cloze_items(corpus_path(), cloze_items) if cloze_items else []
    if generation_prompts:
        check_prompt_source_heldout(cfg)
        prompts = heldout_prompts(tokenizer, generation_prompts, generation_prompt_tokens)
    linear = (cfg.get("init") or {}).get("linear_mixer", InitConfig.linear_mixer)
    teacher = load_teacher(teacher_spec).to(device=device, dtype=torch.float32).eval()
    generation = GenerationScorer(teacher, prompts, generation_tokens) if generation_prompts else None

    stages = [r for r in (_stage_row(out, n, lbl) for n, lbl in STAGE_DIRS) if r is not None]
    tokens_by = {r["stage"]: r.get("tokens") or 0 for r in stages}
    ild_tokens = sum(v for k, v in tokens_by.items() if k.startswith("ILD"))
    models: List[tuple] = [("teacher", 0, lambda: teacher)]
    if (out / "smart" / "smart_report.json").is_file():
        mla_layers, _ = layers_from_report(out / "smart")
        init_hybrid = out / "hybrid_init"
        if not (init_hybrid / "config.json").is_file():
            compose_from_dirs(out / "init" / "mla_student", out / "init" / f"{linear}_student", mla_layers,
                              init_hybrid, overwrite=True)
        models.append(("hybrid, init only", 0, lambda: HybridForCausalLM.from_pretrained(init_hybrid)))
    align_tokens = ild_tokens + tokens_by.get("Alignment", 0)
    kd_tokens = align_tokens + tokens_by.get("KD-SFT", 0)
    long_tokens = kd_tokens + tokens_by.get("Long-context KD", 0)
    for label, trained, path in (("hybrid after ILD", ild_tokens, out / "hybrid"),
                                 ("after alignment", align_tokens, out / "align" / "final"),
                                 ("after KD-SFT", kd_tokens, out / "kd" / "final"),
                                 ("after long-context KD", long_tokens, out / "long_context" / "final"),
                                 ("after DPO", long_tokens + tokens_by.get("DPO", 0), out / "dpo" / "final")):
        if (path / "config.json").is_file():
            models.append((label, trained, lambda p=path: HybridForCausalLM.from_pretrained(p)))

    rows = []
    for label, trained, load in models:
        model = load().to(device=device, dtype=torch.float32).eval()
        row = {"model": label, "tokens_trained": trained}
        for key, text in texts.items():
            r = score(model, teacher, text["windows"])
            suffix = "" if key == "a" else f"_{key}"
            row.update({f"ppl{suffix}": r["ppl"], f"nll{suffix}": r["nll"], f"kl{suffix}": r["kl"]})
        if cloze:
            mc = multiple_choice_accuracy(model, tokenizer, cloze)
            row.update({"cloze_acc": mc["acc"], "cloze_acc_norm": mc["acc_norm"]})
        if generation is not None:
            row.update(generation(model))
        if ruler is not None:
            row.update(ruler(model, tokenizer, label))
        rows.append(row)
        print(json_text(rows[-1]), flush=True)
        if model is not teacher:
            del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report = {"heldout": {key: {"text": t["name"], "seq_len": seq_len, "tokens": sum(w.numel() - 1 for w in t["windows"])}
                          for key, t in texts.items()},
              "targets": {"ppl_ratio": list(targets)}, "perplexity": rows, "stages": stages}
    if cloze:
        report["cloze"] = {"task": "austen_cloze", "items": len(cloze)}
    if generation is not None:
        report["generation"] = {"source": PROMPT_SOURCE, "prompts": int(prompts.shape[0]),
                                "prompt_tokens": int(prompts.shape[1]), "new_tokens": generation_tokens,
                                "ngram": NGRAM, "teacher_ppl": math.exp(min(generation.teacher_nll, 50.0))}
    samples = teacher_samples_summary(out, cfg)
    if samples:
        report["teacher_samples"] = samples
    if ruler is not None:
        report["ruler"] = ruler.write(out / "ruler.json")
    write_json(out / "report.json", report)
    atomic_write_text(str(out / "report.md"), report_markdown(report))
    plot_report(report, out / "report.png")
    print(f"route report: {out / 'report.md'}", flush=True)
    return report


def tokens_axis(ax, xs: List[float]) -> None:
    """The x axis of tokens trained in millions: linear up to the smallest stage's tokens (the init sits at 0),
    logarithmic above, so that a CPU route's 0.2M and a GPU route's 98M both spread their stages; plain numbers."""
    from matplotlib.ticker import FuncFormatter
    ax.set_xscale("symlog", linthresh=min([x for x in xs if x > 1e-6] or [1.0]))
    ax.set_xlim(left=0)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("tokens trained (millions; init at 0)")


def plot_report(report: Dict[str, Any], png: Path) -> Path:
    """Held-out perplexity (a) and (b) against tokens trained, one point per stage, with the teacher's
    perplexity and the target ratios as lines (log scale); with generation scores, a panel of ``gen_ppl_ratio``
    against tokens trained, each point labelled with its repeated 4-gram rate and leading agreement."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["perplexity"]
    keys = [k for k in ("a", "b") if k in report["heldout"]]
    gen = report.get("generation")
    fig, axes = plt.subplots(1, len(keys) + bool(gen), figsize=(6.5 * (len(keys) + bool(gen)), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        field = "ppl" if key == "a" else f"ppl_{key}"
        teacher = next(r[field] for r in rows if r["model"] == "teacher")
        hybrid = [r for r in rows if r["model"] != "teacher"]
        xs = [max(r["tokens_trained"], 1) / 1e6 for r in hybrid]
        ax.plot(xs, [r[field] for r in hybrid], "o-", color="#1f77b4", label="hybrid")
        for n, (x, r) in enumerate(zip(xs, hybrid)):  # alternate sides: DPO's point sits on KD's
            ax.annotate(f"{r['model'].replace('hybrid, ', '').replace('hybrid ', '')}\n{r[field]:.3g}", (x, r[field]),
                        textcoords="offset points", xytext=(4 if n % 2 == 0 else -60, 6 if n % 2 == 0 else -22),
                        fontsize=7)
        ax.axhline(teacher, color="#444444", lw=1.5, label=f"teacher {teacher:.3g}")
        for ratio, style in zip(report["targets"]["ppl_ratio"], ("--", ":")):
            ax.axhline(teacher * ratio, color="#d62728", ls=style, lw=1, label=f"target {ratio:g}x teacher")
        ax.set_yscale("log")
        tokens_axis(ax, xs)
        ax.set_ylabel("perplexity (log scale)")
        h = report["heldout"][key]
        ax.set_title(f"({key}) {h['text'][:60]}: {h['tokens']:,} tokens", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if gen:
        ax = axes[0][len(keys)]
        rep_key = f"gen_repeat{gen['ngram']}"
        hybrid = [r for r in rows if r["model"] != "teacher"]
        xs = [max(r["tokens_trained"], 1) / 1e6 for r in hybrid]
        ax.plot(xs, [r["gen_ppl_ratio"] for r in hybrid], "o-", color="#2ca02c", label="hybrid")
        for n, (x, r) in enumerate(zip(xs, hybrid)):
            ax.annotate(f"{r['model'].replace('hybrid, ', '').replace('hybrid ', '')}\n{r['gen_ppl_ratio']:.3g}x, "
                        f"rep {r[rep_key]:.2f}, agree {r['gen_agree']:.1f}", (x, r["gen_ppl_ratio"]),
                        textcoords="offset points", xytext=(4 if n % 2 == 0 else -60, 6 if n % 2 == 0 else -22),
                        fontsize=7)
        teacher_rep = next(r[rep_key] for r in rows if r["model"] == "teacher")
        ax.axhline(1.0, color="#444444", lw=1.5, label=f"teacher (ppl {gen['teacher_ppl']:.3g}, rep {teacher_rep:.2f})")
        ax.set_yscale("log")
        tokens_axis(ax, xs)
        ax.set_ylabel("teacher ppl of greedy continuation / teacher's own")
        ax.set_title(f"generation: {gen['prompts']} prompts of {gen['source']}, {gen['new_tokens']} greedy tokens",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, png, dpi=120)  # atomic, like the JSON and Markdown beside it
    return png


def teacher_samples_summary(out: Path, cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """What the route's ``sample`` stage wrote and what it cost (None without a finished one)."""
    section = cfg.get("sample")
    if not section:
        return None
    manifest = Path((section or {}).get("out") or out / "samples") / SAMPLES_MANIFEST
    try:
        m = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not m.get("complete"):
        return None
    return {"dir": str(manifest.parent), "rows": m["rows"], "new_tokens": m["new_tokens"],
            "generation_minutes": m["generation_minutes"], "new_tokens_per_second": m["new_tokens_per_second"],
            "settings": m["settings"], "devices": m.get("devices")}


def report_markdown(report: Dict[str, Any]) -> str:
    held = report["heldout"]
    keys = [k for k in ("a", "b") if k in held]
    lines = [f"Held-out ({k}): {held[k]['tokens']:,} tokens of {held[k]['text']}, windows of {held[k]['seq_len']}."
             for k in keys]
    ruler = report.get("ruler")
    if ruler:
        lines.append(f"RULER: mean score over {len(ruler['tasks'])} RULER-style tasks, {ruler['items']} items of each "
                     f"per length, haystack {ruler['haystack']} (per task: {Path(ruler['files']['markdown']).name}).")
    cloze = report.get("cloze")
    if cloze:
        lines.append(f"Cloze: {cloze['task']}, {cloze['items']} items, accuracy (length-normalised in brackets).")
    gen = report.get("generation")
    if gen:
        lines.append(f"Generation: greedy continuations of {gen['new_tokens']} tokens after {gen['prompts']} held-out "
                     f"prompts ({gen['prompt_tokens']}-token prefixes of {gen['source']}); gen ppl = the teacher's "
                     f"perplexity of the continuation, ratio = that / the teacher's perplexity of its own greedy "
                     f"continuation ({gen['teacher_ppl']:.3f}); repeat = fraction of the continuation's "
                     f"{gen['ngram']}-grams that occurred earlier in it; agree = mean leading tokens equal to the "
                     f"teacher's greedy continuation.")
    samples = report.get("teacher_samples")
    if samples:
        st = samples["settings"]
        lines.append(f"Teacher samples: {samples['rows']:,} continuations, {samples['new_tokens']:,} new tokens "
                     f"(prompts of {st['prompt_len']} tokens, up to {st['gen_len']} new, temperature "
                     f"{st['temperature']}, top-p {st['top_p']}) in {samples['generation_minutes']} minutes of "
                     f"generation, {samples['new_tokens_per_second']:,} tokens/s ({samples['dir']}).")
    cols = " | ".join(f"perplexity ({k}) | KL ({k}), nats/token" for k in keys) + (" | cloze acc" if cloze else "")
    cols += f" | gen ppl | gen ppl ratio | repeat {gen['ngram']}-gram | agree, tokens" if gen else ""
    ruler_lengths = [str(L) for L in ruler["lengths"]] if ruler else []
    cols += "".join(f" | RULER @ {L}, %" for L in ruler_lengths)
    lines += ["", f"| model | tokens trained | {cols} |", "|---|---|" + "---|---|" * len(keys) + ("---|" if cloze else "")
              + ("---|---|---|---|" if gen else "") + "---|" * len(ruler_lengths)]
    for r in report["perplexity"]:
        cells = " | ".join(f"{r['ppl' if k == 'a' else 'ppl_' + k]:.2f} | {r['kl' if k == 'a' else 'kl_' + k]:.4f}"
                           for k in keys)
        if cloze:
            cells += f" | {r['cloze_acc']:.3f} ({r['cloze_acc_norm']:.3f})"
        if gen:
            repeat = r[f"gen_repeat{gen['ngram']}"]
            cells += (f" | {r['gen_ppl']:.3f} | {r['gen_ppl_ratio']:.3f} | {repeat:.3f} | "
                      f"{r['gen_agree']:.1f}")
        cells += "".join(f" | {100 * r[f'ruler_{L}']:.1f}" for L in ruler_lengths)
        lines.append(f"| {r['model']} | {r['tokens_trained']:,} | {cells} |")
    lines += ["", "| stage | steps | tokens | minutes | held-out DPO reward accuracy |", "|---|---|---|---|---|"]
    for s in report["stages"]:
        acc = s.get("dpo_heldout", {}).get("rewards/accuracies")
        steps = s["steps"] if s.get("max_steps") in (None, s["steps"]) else f"{s['steps']} of {s['max_steps']} (stopped early)"
        lines.append(f"| {s['stage']} | {steps} | {s['tokens']:,} | {s['minutes']} | "
                     f"{'' if acc is None else f'{acc:.3f}'} |")
    return "\n".join(lines) + "\n"
