"""The acceptance run on a CUDA host: every part a subprocess with its own log, one JSON report rewritten after each
part (a run cut short keeps what it finished), and a one-screen summary. ``bash benchmarks/acceptance.sh OUT_DIR``
is the entry point (it checks the host first); this module is its runner and the report's schema.

    python -m benchmarks.acceptance --out OUT_DIR [--parts pretrain route generate gpu_tests]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "hybridlm-acceptance/1"
PARTS = ("pretrain", "route", "generate", "gpu_tests")
# the report's fields and each part's: what tests/test_acceptance.py holds the writer to
REPORT_FIELDS = {"schema": str, "passed": bool, "started": str, "wall_seconds": float, "commit": (str, type(None)),
                 "host": dict, "tuning": str, "first_step_seconds": (float, type(None)), "parts": list}
PART_FIELDS = {"name": str, "passed": bool, "seconds": float, "exit_code": int, "log": str, "summary": str,
               "counts": dict}
HOST_FIELDS = ("gpu", "gpus", "python", "torch", "cuda", "triton", "flash-linear-attention", "deepspeed",
               "transformers")


@dataclass
class Part:
    """One part: the command, its time limit, and how its log turns into counts and a summary line."""
    name: str
    argv: List[str]
    timeout: int
    env: Dict[str, str] = field(default_factory=dict)
    read: Optional[Callable[[str, Path], dict]] = None  # (log text, out dir) -> counts (and "summary")
    before: Optional[Callable[[Path], None]] = None     # set-up run in this process before the command


def _pytest_counts(junit: Path) -> Callable[[str, Path], dict]:
    def read(log: str, out: Path) -> dict:
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if junit.is_file():
            for suite in ET.parse(junit).getroot().iter("testsuite"):
                for k in counts:
                    counts[k] += int(suite.get(k, 0))
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        tail = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
        counts["summary"] = tail[-1].strip("= ") if tail else "no pytest summary line"
        return counts
    return read


def _first_step(log: str, out: Path) -> dict:
    """The pre-training log's first-step line and the last logged loss."""
    counts: dict = {}
    m = re.search(r"first step done in ([0-9.]+) s", log)
    if m:
        counts["first_step_seconds"] = float(m.group(1))
    steps = re.findall(r"step (\d+)[^\n]*?loss ([0-9.]+)", log)
    if steps:
        counts["last_step"], counts["last_loss"] = int(steps[-1][0]), float(steps[-1][1])
    counts["summary"] = (f"first step {counts.get('first_step_seconds', '?')} s; step {counts.get('last_step', '?')} "
                         f"loss {counts.get('last_loss', '?')}")
    return counts


def _route_stages(log: str, out: Path) -> dict:
    stages = [l.split()[3] for l in log.splitlines() if l.startswith("route: stage ")]
    report = out / "route" / "report.json"
    ppl = {}
    if report.is_file():
        ppl = {r["model"]: r["ppl"] for r in json.loads(report.read_text()).get("perplexity", [])}
    return {"stages": stages, "ppl": ppl, "summary": f"{len(stages)} stages: {' '.join(stages)}"}


def _twin_teacher(out: Path) -> None:
    """A random-weight Llama of SmolLM2-135M-Instruct's layer shapes with the Llama-3.2 tokenizer (shipped as an
    asset, so nothing is fetched), saved as the route smoke's teacher."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.route_twin import SMOLLM2
    from hybridlm.data import load_tokenizer
    teacher = out / "teacher"
    if (teacher / "config.json").is_file():
        return
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SMOLLM2, "vocab_size": len(tok)}, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(teacher)
    tok.save_pretrained(teacher)


def parts(out: Path, data: Path, py: str = sys.executable) -> Dict[str, Part]:
    """The acceptance parts, in run order, writing under ``out``; ``data``: Jane Austen's novels prepared with the
    Llama-3.2 tokenizer (benchmarks/common.sh ``prepare_data``)."""
    steps = ["optim.micro_batch_size=2", "optim.global_batch_size=2", "optim.max_steps=2", "optim.warmup_steps=1",
             "run.progress=false", "run.eval_interval=0", "run.save_interval=0", "data.val_max_batches=1"]
    route = [f"output_dir={out / 'route'}", f"teacher={out / 'teacher'}", "init.calib_tokens=2048",
             "init.calib_seq_len=256", f"ild.data.path={out / 'route_data'}", "smart.batches=2", "smart.batch_size=2",
             "kd.data.max_length=256", "dpo.data.max_length=256", "dpo.data.max_prompt_length=128",
             "report.seq_len=256", "report.max_tokens=4096", "report.generation_prompts=2"]
    steps.append("optim.precision=bf16")
    route += [f"{stage}.{o}" for stage in ("ild", "kd", "dpo") for o in steps]
    pretrain = ["--config", "configs/experiments/gdn_300m.yaml", f"data.path={data}", "optim.micro_batch_size=16",
                "optim.global_batch_size=32", "optim.max_steps=30", "optim.warmup_steps=5", "run.eval_interval=15",
                "run.save_interval=15", "run.log_interval=1", "data.val_max_batches=2", "run.sample_tokens=16",
                f"run.output_dir={out / 'pretrain'}"]
    launcher = [py, "-m", "deepspeed.launcher.runner", "--master_port", os.environ.get("MASTER_PORT", "29500"),
                "--no_local_rank", "--num_gpus", "1"]
    pytest = [py, "-m", "pytest", "-o", "addopts=", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider"]
    return {
        "pretrain": Part("pretrain", [*launcher, "pretrain.py", *pretrain], 900, read=_first_step),
        "route": Part("route", [py, "-m", "upcycle.cli", "run", "--config", "configs/upcycle/smollm2_route_cpu.yaml",
                                *route], 900, read=_route_stages, before=_twin_teacher),
        "generate": Part("generate", [*pytest, "--junitxml", str(out / "generate.xml"),
                                      "tests/test_generate_fast_path.py"], 900,
                         env={"HYBRIDLM_TEST_DEVICE": "cuda"}, read=_pytest_counts(out / "generate.xml")),
        "gpu_tests": Part("gpu_tests", [*pytest, "-m", "gpu", "--junitxml", str(out / "gpu_tests.xml"), "tests"],
                          3600, read=_pytest_counts(out / "gpu_tests.xml")),
    }


def _version(dist: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None


def host_facts() -> dict:
    import torch
    cuda = torch.cuda.is_available()
    facts = {"gpu": torch.cuda.get_device_name() if cuda else None, "gpus": torch.cuda.device_count() if cuda else 0,
             "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    facts.update({d: _version(d) for d in HOST_FIELDS[5:]})
    return facts


def _commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def new_report(host: dict, tuning: str) -> dict:
    return {"schema": SCHEMA, "passed": False, "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_seconds": 0.0, "commit": _commit(), "host": host, "tuning": tuning, "first_step_seconds": None,
            "parts": []}


def run_part(part: Part, out: Path) -> dict:
    """Run ``part`` (its output into OUT/<name>.log) and return its entry of the report."""
    log = out / f"{part.name}.log"
    t0 = time.monotonic()
    code = None
    with open(log, "w") as fh:
        try:
            if part.before:
                part.before(out)
            proc = subprocess.run(part.argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=part.timeout,
                                  env={**os.environ, **part.env})
            code = proc.returncode
        except subprocess.TimeoutExpired:
            fh.write(f"\nacceptance: {part.name} stopped at its limit of {part.timeout} s\n")
            code = 124
        except Exception as e:  # the part's set-up failed: the part fails, the run goes on
            fh.write(f"\nacceptance: {part.name} could not start: {type(e).__name__}: {e}\n")
            code = 125
    seconds = round(time.monotonic() - t0, 1)
    text = log.read_text(errors="replace")
    counts = part.read(text, out) if part.read else {}
    summary = counts.pop("summary", "") if counts else ""
    if code == 124:
        summary = f"stopped at its limit of {part.timeout} s; {summary}"
    return {"name": part.name, "passed": code == 0, "seconds": seconds, "exit_code": code, "log": log.name,
            "summary": summary, "counts": counts}


def finish(report: dict, t0: float, planned: int) -> dict:
    report["wall_seconds"] = round(time.monotonic() - t0, 1)
    report["passed"] = len(report["parts"]) == planned and all(p["passed"] for p in report["parts"])
    for p in report["parts"]:
        if p["name"] == "pretrain" and "first_step_seconds" in p["counts"]:
            report["first_step_seconds"] = p["counts"]["first_step_seconds"]
    return report


def check_report(report: dict) -> None:
    """Raise ValueError naming the first field of ``report`` that is missing or of the wrong type."""
    for key, kind in REPORT_FIELDS.items():
        if key not in report or not isinstance(report[key], kind):
            raise ValueError(f"acceptance report: {key!r} missing or not {kind}")
    if report["schema"] != SCHEMA:
        raise ValueError(f"acceptance report: schema {report['schema']!r} is not {SCHEMA!r}")
    missing = [k for k in HOST_FIELDS if k not in report["host"]]
    if missing:
        raise ValueError(f"acceptance report: host lacks {missing}")
    for i, part in enumerate(report["parts"]):
        for key, kind in PART_FIELDS.items():
            if key not in part or not isinstance(part[key], kind):
                raise ValueError(f"acceptance report: parts[{i}].{key} missing or not {kind.__name__}")


def summary(report: dict) -> str:
    """The one-screen summary of a report."""
    h = report["host"]
    lines = [f"acceptance: {'PASSED' if report['passed'] else 'FAILED'} in {report['wall_seconds']:.0f} s on "
             f"{h['gpu']} (torch {h['torch']}, CUDA {h['cuda']}, Triton {h['triton']}, fla "
             f"{h['flash-linear-attention']}, commit {report['commit']})", f"  {report['tuning']}"]
    for p in report["parts"]:
        lines.append(f"  {'ok  ' if p['passed'] else 'FAIL'} {p['name']:<10} {p['seconds']:7.1f} s  {p['summary']}")
    if report["first_step_seconds"] is not None:
        lines.append(f"  GDN-300M's first optimizer step: {report['first_step_seconds']:.1f} s")
    return "\n".join(lines)


def run(out: Path, names: List[str], data: Path, tuning: str) -> dict:
    from hybridlm.utils.atomic import write_json
    out.mkdir(parents=True, exist_ok=True)
    table = parts(out, data)
    t0 = time.monotonic()
    report = new_report(host_facts(), tuning)
    for name in names:
        print(f"acceptance: {name} ...", flush=True)
        report["parts"].append(run_part(table[name], out))
        finish(report, t0, len(names))
        check_report(report)
        write_json(out / "acceptance.json", report)
        p = report["parts"][-1]
        print(f"acceptance: {name} {'ok' if p['passed'] else 'FAILED'} in {p['seconds']:.1f} s: {p['summary']}",
              flush=True)
    (out / "summary.txt").write_text(summary(report) + "\n")
    print(summary(report), flush=True)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--data", required=True, type=Path, help="prepared Jane Austen shards for the pre-training part")
    ap.add_argument("--tuning", default="", help="the shipped tuning's status line")
    args = ap.parse_args(argv)
    report = run(args.out, args.parts, args.data, args.tuning)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
