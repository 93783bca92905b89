"""Old against new: the same tiny CPU jobs in two checkouts, every per-step figure and every saved tensor compared
bit for bit. For refactors that must not change behaviour.

    python benchmarks/harness/equivalence.py versus OLD_CHECKOUT [--new NEW_CHECKOUT] --out DIR [--jobs a,b]
    python benchmarks/harness/equivalence.py compare A.json B.json

Jobs (each a real CLI run in a subprocess, the checkout first on PYTHONPATH):
  pretrain_fp32    ``pretrain.py`` on the embedded default, 8 steps, checkpoints at 3 and 6, validation at 4 and 8
  pretrain_bf16    the same in bf16 autocast
  pretrain_resume  the fp32 run killed (SIGKILL) after step 5, then rerun: it resumes from step 3's checkpoint
  route_levers     ``upcycle run`` of configs/upcycle/smollm2_levers_cpu.yaml on a tiny random Llama: init, ILD x2,
                   SMART (kl_restore), compose, align, sample, KD on a weighted mix (wsd), DPO, report
  route_gdn        configs/upcycle/smollm2_route_cpu.yaml with the Gated DeltaNet student: init, ILD x2, SMART,
                   compose, KD, DPO, report

Recorded per job: every numeric leaf of every ``metrics.jsonl`` row and of every JSON file the run wrote (timings,
speeds and memory left out), the sha256 of every ``.safetensors`` tensor (name, dtype, shape, bytes) and of every
teacher-sample shard. Both checkouts run the same jobs on the same tiny teacher with the same thread count, one
after the other.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]
# figures that measure the machine, not the computation
VOLATILE = re.compile(r"time|elapsed|second|minute|hour|_s$|per_s|tok_s|tokens_per|throughput|mfu|mem|eta$|wall|"
                      r"date|pid|speed|duration|started|finished_at|_at$|bytes_free|gib|mib|^files$", re.I)
# ("files": name / size / mtime stamps of the files a record was made from)
SKIP_JSON = re.compile(r"tokenizer|vocab|special_tokens|generation_config|\.lock")

PRETRAIN = ["--config", "configs/experiments/default_cpu.yaml", "data.val_max_batches=2", "optim.warmup_steps=2",
            "optim.max_steps=8", "run.eval_interval=4", "run.save_interval=3", "run.sample_tokens=4",
            "run.progress=false"]
SMALL = ["optim.micro_batch_size=2", "optim.global_batch_size=2", "optim.max_steps=2", "optim.warmup_steps=1",
         "run.progress=false", "run.eval_interval=0", "run.save_interval=0", "data.val_max_batches=1"]
ROUTE_COMMON = ["init.kv_lora_rank=32", "init.qk_rope_head_dim=8", "init.calib_tokens=512", "init.calib_seq_len=64",
                "ild.data.seq_len=32", "smart.n_mla=2", "smart.batches=1", "smart.batch_size=2",
                "dpo.data.max_length=64", "dpo.data.max_prompt_length=32", "report.seq_len=32",
                "report.max_tokens=256", "report.generation_prompts=0"]


def tiny_teacher(out: Path) -> Path:
    """A tiny random Llama (4 layers, hidden 64, GQA 4/2) with the real Llama-3.2 tokenizer, made once per
    comparison and handed to both checkouts."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    from hybridlm.data import load_tokenizer
    hf_logging.disable_progress_bar()
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=len(tok), tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def job_commands(name: str, work: Path, teacher: Path) -> List[List[str]]:
    """The argv list(s) of one job, run in order; ``work`` is the job's own directory."""
    py = sys.executable
    if name.startswith("pretrain"):
        args = [py, "pretrain.py", *PRETRAIN, f"data.path={work / 'data'}", f"run.output_dir={work / 'run'}"]
        if name == "pretrain_bf16":
            args.append("optim.precision=bf16")
        return [args, args] if name == "pretrain_resume" else [args]
    route = [py, "-m", "upcycle.cli", "run", f"output_dir={work / 'route'}", f"teacher={teacher}", *ROUTE_COMMON,
             f"ild.data.path={work / 'data'}"]
    if name == "route_gdn":
        route[4:4] = ["--config", "configs/upcycle/smollm2_route_cpu.yaml"]
        return [route + ["init.linear_mixer=gdn", "ild.data.sources=[asset:alpaca_en_demo]",
                         "kd.data.path=asset:alpaca_en_demo", "kd.data.max_length=64",
                         *[f"{s}.{o}" for s in ("ild", "kd", "dpo") for o in SMALL]]]
    if name == "route_levers":
        import yaml
        config = yaml.safe_load((REPO / "configs/upcycle/smollm2_levers_cpu.yaml").read_text())
        config["kd"]["data"] = {"format": "packed", "path": str(work / "kd_mix"), "seq_len": 32,
                                "tokenizer": "teacher", "sources": ["asset:alpaca_en_demo",
                                                                   {"source": str(work / "route" / "samples"),
                                                                    "weight": 2}]}
        (work / "levers.yaml").write_text(yaml.safe_dump(config))
        route[4:4] = ["--config", str(work / "levers.yaml")]
        return [route + [f"align.data.path={work / 'data'}", "align.data.seq_len=32", "dpo.optim.lr=1e-3",
                         "sample={tokens: 48, prompt_len: 8, gen_len: 8, batch_size: 3, cache: dynamic}",
                         "kd.optim.schedule=wsd", "kd.optim.decay_fraction=0.5",
                         *[f"{s}.{o}" for s in ("ild", "align", "kd", "dpo") for o in SMALL]]]
    raise SystemExit(f"error: --jobs: unknown job {name!r} (known: {', '.join(JOBS)})")


JOBS = ("pretrain_fp32", "pretrain_bf16", "pretrain_resume", "route_levers", "route_gdn")


def numeric_leaves(value, prefix: str, out: Dict[str, float]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not VOLATILE.search(str(k)):
                numeric_leaves(v, f"{prefix}.{k}", out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            numeric_leaves(v, f"{prefix}[{i}]", out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = repr(value)  # repr: NaN compares equal to NaN, 0.1 + 0.2 keeps every bit


def tensor_hashes(path: Path) -> Dict[str, str]:
    import torch
    from safetensors import safe_open
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for key in sorted(f.keys()):
            t = f.get_tensor(key).contiguous()
            h = hashlib.sha256(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            out[key] = h.hexdigest()[:16]
    return out


def collect(work: Path) -> Dict[str, Dict[str, str]]:
    figures: Dict[str, str] = {}
    tensors: Dict[str, str] = {}
    for path in sorted(work.rglob("*")):
        rel = str(path.relative_to(work))
        if not path.is_file() or "/data/" in f"/{rel}" or rel.startswith(("data", "kd_mix")):
            continue
        if path.name == "metrics.jsonl":
            for i, line in enumerate(path.read_text().splitlines()):
                if line.strip():
                    row = json.loads(line)
                    numeric_leaves(row, f"{rel}#{row.get('step', i)}:{'val' if 'val_loss' in row else 'train'}",
                                   figures)
        elif path.suffix == ".json" and not SKIP_JSON.search(path.name):
            try:
                numeric_leaves(json.loads(path.read_text()), rel, figures)
            except ValueError:
                figures[rel] = "unreadable"
        elif path.suffix == ".safetensors":
            tensors.update({f"{rel}:{k}": v for k, v in tensor_hashes(path).items()})
        elif path.name.startswith("shard_") and path.suffix == ".jsonl":
            tensors[rel] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return {"figures": figures, "tensors": tensors}


def record(checkout: Path, out: Path, jobs: List[str], teacher: Path) -> Dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDLM_FAULT", "MASTER_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_RANK"))}
    env.update(PYTHONPATH=str(checkout), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="2", PYTHONHASHSEED="0")
    result = {"checkout": str(checkout), "commit": _commit(checkout), "jobs": {}}
    for name in jobs:
        work = out / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        t0 = time.time()
        for i, argv in enumerate(job_commands(name, work, teacher)):
            run_env = dict(env)
            if name == "pretrain_resume" and i == 0:
                run_env["HYBRIDLM_FAULT_KILL_AT_STEP"] = "5"
            proc = subprocess.run(argv, cwd=checkout, env=run_env, capture_output=True, text=True, timeout=3600)
            (work / f"run{i}.log").write_text(proc.stdout + proc.stderr)
            killed = name == "pretrain_resume" and i == 0
            if proc.returncode != 0 and not (killed and proc.returncode == -9):
                raise SystemExit(f"error: {name} in {checkout}: exit {proc.returncode}; log {work / f'run{i}.log'}")
        result["jobs"][name] = {**collect(work), "seconds": round(time.time() - t0, 1)}
        print(f"equivalence: {checkout.name}: {name} in {time.time() - t0:.0f} s", flush=True)
    return result


def compare(old: Dict, new: Dict) -> bool:
    print(f"| job | figures | differ | tensors | differ | old s | new s |\n|---|---|---|---|---|---|---|")
    same = True
    lines = []
    for name in old["jobs"]:
        a, b = old["jobs"][name], new["jobs"].get(name)
        if b is None:
            print(f"| {name} | missing in new | | | | | |")
            same = False
            continue
        counts = []
        for kind in ("figures", "tensors"):
            keys = set(a[kind]) | set(b[kind])
            bad = sorted(k for k in keys if a[kind].get(k) != b[kind].get(k))
            counts += [len(keys), len(bad)]
            lines += [f"  {name} {kind}: {k}: {a[kind].get(k)} -> {b[kind].get(k)}" for k in bad[:10]]
            same &= not bad
        print(f"| {name} | {counts[0]} | {counts[1]} | {counts[2]} | {counts[3]} | {a['seconds']} | {b['seconds']} |")
    for line in lines:
        print(line)
    print(f"equivalence: {'bit-identical' if same else 'DIFFERENT'} ({old['commit']} -> {new['commit']})")
    return same


def _commit(checkout: Path) -> str:
    proc = subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty"], capture_output=True,
                          text=True)
    return proc.stdout.strip() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("versus", help="run the jobs in OLD and NEW (default: this checkout), then compare")
    v.add_argument("old", type=Path)
    v.add_argument("--new", type=Path, default=REPO)
    v.add_argument("--out", type=Path, required=True)
    v.add_argument("--jobs", default=",".join(JOBS))
    c = sub.add_parser("compare", help="compare two recorded JSON files")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "compare":
        return 0 if compare(json.loads(args.a.read_text()), json.loads(args.b.read_text())) else 1
    jobs = [j for j in args.jobs.split(",") if j]
    for j in jobs:
        if j not in JOBS:
            raise SystemExit(f"error: --jobs: unknown job {j!r} (known: {', '.join(JOBS)})")
    for checkout in (args.old, args.new):
        if not (checkout / "pretrain.py").is_file():
            raise SystemExit(f"error: {checkout}: not a checkout of this toolkit (no pretrain.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    teacher = tiny_teacher(args.out / "teacher")
    results = {}
    for side, checkout in (("old", args.old.resolve()), ("new", args.new.resolve())):
        results[side] = record(checkout, args.out / side, jobs, teacher)
        (args.out / f"{side}.json").write_text(json.dumps(results[side], indent=1))
    return 0 if compare(results["old"], results["new"]) else 1


if __name__ == "__main__":
    sys.exit(main())
