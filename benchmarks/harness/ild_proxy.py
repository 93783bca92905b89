"""CPU proxy of the route's ILD stage: a few of the teacher's layers converted to Mamba2 and trained by the ILD
loss. ILD is teacher-forced, so each layer's problem is exactly the one it has in the full route; training 4 of
30 layers costs a teacher forward plus 4 layers, a few minutes on 2 cores. It ranks init and learning-rate
choices before GPU minutes are spent on them (BENCHMARKS.md, "Upcycling quality").

    python -m benchmarks.harness.ild_proxy --variants ours:1e-3 published:1e-3 random:1e-3 ours:3e-4 --steps 120 \
        --out docs/results/ild_proxy.json

A variant is ``init:lr``: ``ours`` (upcycle init: identity conv, constant gate, calibrated output scale),
``published`` (MambaInLlama's mapping as published), ``random`` (the same layers with the default
from-scratch init, nothing copied from attention). Reported per evaluation: the held-out relative error of
the mixer outputs, sum ||a_s - a_t||^2 / sum ||a_t||^2 (1.0 = a silent mixer), averaged over the layers, and
the held-out perplexity of the teacher with those layers swapped for the student's (the end-to-end effect;
the teacher's own perplexity is the floor). The JSON and PNG hold both curves.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from distill.ild import teacher_trace
from hybridlm.data.assets import corpus_path
from hybridlm.eval.perplexity import token_windows
from hybridlm.model import HybridForCausalLM
from hybridlm.utils.atomic import json_text, save_figure, write_json
from upcycle.calibrate import calibrate_student
from upcycle.init_from_teacher import init_student_from_teacher
from benchmarks.harness.init_variants import published_mamba2
from upcycle.student import student_config
from hybridlm.teacher import load_teacher, load_teacher_tokenizer

INITS = ("ours", "published", "random")


def build_student(teacher, init: str, calib_ids, layers, seed: int = 0):
    L = teacher.config.num_hidden_layers
    kinds = ["mamba2"] * L
    torch.manual_seed(seed)
    student = HybridForCausalLM(student_config(teacher.config, kinds, kv_lora_rank=128, qk_rope_head_dim=16)).float()
    if init != "random":
        init_student_from_teacher(student, teacher, kinds)
        if init == "published":
            for n, i in enumerate(layers):
                published_mamba2(student.model.layers[2 * i].mixer, seed + n)
        else:
            calibrate_student(student, teacher, calib_ids, [k if i in layers else "skip" for i, k in enumerate(kinds)])
    return student


def layer_losses(student, trace, layers):
    """ILD terms of the chosen layers: (sum of mean ||y_s - y_t|| + mean ||a_s - a_t||, mixer rel. errors)."""
    total, rel = 0.0, []
    for i in layers:
        x, a, y = trace[i]
        mixer_block, mlp_block = student.model.layers[2 * i], student.model.layers[2 * i + 1]
        a_s = mixer_block.mixer(mixer_block.norm(x))
        y_s = mlp_block(x + a_s)
        total = total + (y_s - y).norm(dim=-1).mean() + (a_s - a).norm(dim=-1).mean()
        rel.append(((a_s - a).detach().double().pow(2).sum() / a.double().pow(2).sum()).item())
    return total, rel


@torch.no_grad()
def swapped_perplexity(teacher, student, layers, ids) -> float:
    """Perplexity of ``ids`` under the teacher with its decoder layers ``layers`` replaced by the student's
    (Mamba2 mixer block + MLP block); with no layers, the teacher's own."""
    def replace(i):
        mixer_block, mlp_block = student.model.layers[2 * i], student.model.layers[2 * i + 1]

        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = mlp_block(x + mixer_block.mixer(mixer_block.norm(x)))
            return (y,) + tuple(output[1:]) if isinstance(output, tuple) else y
        return hook

    handles = [teacher.model.layers[i].register_forward_hook(replace(i), with_kwargs=True) for i in layers]
    try:
        loss = teacher(input_ids=ids, labels=ids, use_cache=False).loss
    finally:
        for h in handles:
            h.remove()
    return math.exp(loss.item())


def run_variant(teacher, train_ids, held_ids, held_trace, calib_ids, init, lr, layers, steps, batch, eval_every):
    student = build_student(teacher, init, calib_ids, layers)
    params = [p for i in layers for blk in (student.model.layers[2 * i], student.model.layers[2 * i + 1])
              for p in blk.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    curve = []

    def evaluate(step):
        with torch.no_grad():
            _, rel = layer_losses(student, held_trace, layers)
        curve.append({"step": step, "tokens": step * batch * train_ids.shape[1], "rel_err": sum(rel) / len(rel),
                      "per_layer": rel, "ppl": swapped_perplexity(teacher, student, layers, held_ids)})
        print(json_text({"init": init, "lr": lr, **curve[-1]}), flush=True)

    evaluate(0)
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        ids = train_ids[torch.randint(0, train_ids.shape[0], (batch,), generator=g)]
        trace = teacher_trace(teacher, ids)
        loss, _ = layer_losses(student, trace, layers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == steps:
            evaluate(step)
    return curve


def plot_curves(results, png: Path, teacher_ppl: float = None) -> Path:
    """Against ILD tokens, one line per variant: the held-out relative error of the mixer outputs (left) and,
    when measured, the held-out perplexity of the teacher with the layers swapped (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with_ppl = all("ppl" in c for r in results for c in r["curve"])
    fig, axes = plt.subplots(1, 2 if with_ppl else 1, figsize=(12 if with_ppl else 7, 4.5), squeeze=False)
    panels = [("rel_err", "held-out relative error of the mixer output")]
    if with_ppl:
        panels.append(("ppl", "held-out perplexity, teacher with the layers swapped"))
    for ax, (key, label) in zip(axes[0], panels):
        for r in results:
            ax.plot([c["tokens"] / 1e3 for c in r["curve"]], [c[key] for c in r["curve"]], "o-",
                    label=f"{r['init']} init, lr {r['lr']:g}")
        if key == "rel_err":
            ax.axhline(1.0, color="#444444", lw=1, ls="--", label="silent mixer")
        elif teacher_ppl is not None:
            ax.axhline(teacher_ppl, color="#444444", lw=1, ls="--", label=f"teacher {teacher_ppl:.1f}")
        ax.set_yscale("log")
        ax.set_xlabel("ILD tokens (thousands)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("CPU ILD proxy: Mamba2 layers teacher-forced", fontsize=10)
    fig.tight_layout()
    save_figure(fig, png, dpi=120)
    return png


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="asset:smollm2")
    p.add_argument("--variants", nargs="+", default=["ours:1e-3", "published:1e-3", "random:1e-3"])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 9, 17, 25])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--out", default="ild_proxy.json")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = load_teacher_tokenizer(args.teacher)
    teacher = load_teacher(args.teacher, dtype=torch.float32).eval()
    books = sorted(Path(corpus_path()).glob("*.txt"))
    train_text = [b.read_text() for b in books[2:]]                 # four novels train ...
    train_ids = torch.stack(token_windows(tok, train_text, args.seq_len, 400_000))[:, :-1]
    held = torch.stack(token_windows(tok, [books[1].read_text()[200000:260000]], args.seq_len, 4 * args.seq_len))[:, :-1]
    calib = torch.stack(token_windows(tok, [books[0].read_text()[100000:160000]], args.seq_len, 1024))[:, :-1]
    held_trace = teacher_trace(teacher, held)                        # ... one holds out, one calibrates
    teacher_ppl = swapped_perplexity(teacher, None, [], held)
    print(json_text({"teacher_ppl": teacher_ppl}), flush=True)
    results = []
    for v in args.variants:
        init, _, lr = v.partition(":")
        if init not in INITS:
            p.error(f"--variants: {v!r}: init must be one of {', '.join(INITS)}")
        t0 = time.perf_counter()
        curve = run_variant(teacher, train_ids, held, held_trace, calib, init, float(lr or 1e-3), args.layers,
                            args.steps, args.batch, args.eval_every)
        results.append({"init": init, "lr": float(lr or 1e-3), "curve": curve,
                        "seconds": round(time.perf_counter() - t0)})
        write_json(Path(args.out), {"layers": args.layers, "seq_len": args.seq_len, "batch": args.batch,
                                    "steps": args.steps, "teacher_ppl": teacher_ppl, "results": results})
        plot_curves(results, Path(args.out).with_suffix(".png"), teacher_ppl)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
