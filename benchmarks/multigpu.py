"""The several-GPU measurements of benchmarks/multigpu.sh (BENCHMARKS.md, "Several GPUs"): the reports it reads
and writes, and the rank it kills.

    python -m benchmarks.multigpu scaling --speed 1=DIR/train_speed.json 8=DIR8/train_speed.json --out JSON
    python -m benchmarks.multigpu losses --reference RUN_DIR --run NAME=RUN_DIR ... [--after-step K] --out JSON
    python -m benchmarks.multigpu kill --rank R --after-step K --metrics RUN_DIR/metrics.jsonl --out JSON -- CMD ...
    python -m benchmarks.multigpu route --one ROUTE_DIR --many ROUTE_DIR --out JSON

``scaling``: per config of ``python -m benchmarks.train_speed`` reports at 1, 2, 4, 8 ranks: tokens/s, tokens/s per
GPU, scaling efficiency (tokens/s per GPU against one GPU's), each rank's peak memory and its ZeRO-1 shard (fp32
master weights and AdamW moments: about 1 / N of one GPU's).
``losses``: the training losses of runs against a reference run, step by step (the steps both logged, after
``--after-step`` where given: the steps a resumed run trained itself), and their validation losses.
``kill``: runs CMD (a multi-rank launch), SIGKILLs the process of rank R once the run's metrics.jsonl has logged step K
(after ``--delay`` seconds more: inside a step), and records how the launch stopped: seconds from the kill to the
launcher's exit, its status, the ranks' processes left alive, the ``error:`` / ``stopped:`` lines and tracebacks.
``route``: two `upcycle run` routes (one GPU, several) stage by stage: each model's perplexities, KL and cloze
accuracy in their report.json, each stage's steps and minutes; with ``--plan-config``, ``upcycle plan``'s GiB per rank
and minutes per stage at 1 and ``--gpus`` ranks; with ``--memory``, the most memory each GPU had in use during each
route (nvidia-smi).
Each writes its JSON atomically; ``within`` fields compare against ``--rtol`` (relative, default 0.01).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hybridlm.utils.atomic import write_json

SCHEMA = "hybridlm-multigpu/1"


def fail(message: str) -> None:
    raise SystemExit(f"error: {message}")


def named_paths(items: Sequence[str], flag: str) -> List[Tuple[str, Path]]:
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            fail(f"{flag} {item!r}: expected NAME=PATH")
        out.append((name, Path(path)))
    return out


def read_json(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        fail(f"{path}: no such file")
    except json.JSONDecodeError as e:
        fail(f"{path}: not JSON ({e})")


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def header(kind: str) -> Dict[str, Any]:
    return {"schema": SCHEMA, "kind": kind, "written": datetime.now(timezone.utc).isoformat(timespec="seconds")}


# ---------------------------------------------------------------------------------------------- scaling

def scaling(speed: Sequence[Tuple[str, Path]]) -> Dict[str, Any]:
    """Per config (train_speed's entries of our step), the runs at each rank count against the one-rank run."""
    reports = []
    for n, path in speed:
        if not n.isdigit() or int(n) < 1:
            fail(f"--speed {n}={path}: expected RANKS=PATH with RANKS a count of GPUs")
        report = read_json(path)
        if report.get("world_size") != int(n):
            fail(f"{path}: world_size {report.get('world_size')}, not {n}")
        reports.append((int(n), path, report))
    reports.sort(key=lambda r: r[0])
    configs: Dict[str, List[Dict[str, Any]]] = {}
    for n, path, report in reports:
        for e in report["entries"]:
            if e.get("kind") != "ours":
                continue
            row: Dict[str, Any] = {"ranks": n, "status": e["status"], "report": str(path)}
            if e["status"] == "ok":
                ranks = e.get("ranks") or []
                row.update(micro_batch=e["micro_batch"], global_batch=e["global_batch"],
                           tokens_per_s=e["tokens_per_s"], tokens_per_s_per_gpu=e["tokens_per_s_per_gpu"],
                           step_ms=e["step_ms"], mfu=e["mfu"],
                           peak_gib_per_rank=[r.get("peak_gib") for r in ranks],
                           optimizer_shard_gib_per_rank=[r["master_gib"] + r["adam_moments_gib"] for r in ranks])
            configs.setdefault(e["name"], []).append(row)
    for rows in configs.values():
        one = next((r for r in rows if r["ranks"] == 1 and r["status"] == "ok"), None)
        for r in rows:
            if one is None or r["status"] != "ok":
                continue
            r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
            if one["optimizer_shard_gib_per_rank"] and r["optimizer_shard_gib_per_rank"]:
                # ZeRO-1: each of N ranks holds about 1 / N of one rank's optimizer state
                r["optimizer_shard_of_one_gpu"] = max(r["optimizer_shard_gib_per_rank"]) / \
                    one["optimizer_shard_gib_per_rank"][0]
    gpu = next((r.get("gpu") for _, _, r in reports if r.get("gpu")), None)
    return {**header("scaling"), "gpu": gpu, "configs": configs}


# ---------------------------------------------------------------------------------------------- losses

def metric_rows(run_dir: Path) -> List[Dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        fail(f"{path}: no such file (a pretrain.py run directory was expected)")
    rows = []
    for line in text.splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    return rows


def by_step(rows: List[Dict[str, Any]], key: str) -> Dict[int, float]:
    """The last logged value of ``key`` at each step (a resumed run logs its steps again after the checkpoint)."""
    return {r["step"]: float(r[key]) for r in rows if key in r and r.get("step") is not None}


def compare_losses(reference: Path, run: Path, after_step: int, rtol: float) -> Dict[str, Any]:
    want, got = metric_rows(reference), metric_rows(run)
    out: Dict[str, Any] = {"run": str(run)}
    for key in ("loss", "val_loss"):
        w, g = by_step(want, key), by_step(got, key)
        steps = sorted(s for s in set(w) & set(g) if s > after_step)
        if not steps:
            out[key] = {"steps": 0}
            continue
        diffs = [rel(g[s], w[s]) for s in steps]
        worst = max(range(len(steps)), key=lambda i: diffs[i])
        out[key] = {"steps": len(steps), "first_step": steps[0], "first": g[steps[0]], "first_reference": w[steps[0]],
                    "first_rel_diff": diffs[0], "last_step": steps[-1], "last": g[steps[-1]],
                    "last_reference": w[steps[-1]], "max_rel_diff": diffs[worst], "max_rel_diff_step": steps[worst],
                    "mean_rel_diff": sum(diffs) / len(diffs), "within": diffs[worst] <= rtol,
                    "curve": [[s, g[s], w[s]] for s in steps]}
    return out


def losses(reference: Path, runs: Sequence[Tuple[str, Path]], after_step: int, rtol: float) -> Dict[str, Any]:
    compared = {name: compare_losses(reference, path, after_step, rtol) for name, path in runs}
    for name, c in compared.items():
        if c["loss"]["steps"] == 0:
            fail(f"{name}: no training step after step {after_step} logged by both {reference} and {c['run']}")
    return {**header("losses"), "reference": str(reference), "after_step": after_step, "rtol": rtol,
            "runs": compared, "within": all(c["loss"]["within"] for c in compared.values())}


# ---------------------------------------------------------------------------------------------- kill

def logged_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return 0
    step = 0
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in row:
            step = max(step, int(row.get("step") or 0))
    return step


def rank_processes(root: int) -> Dict[int, int]:
    """``rank: pid`` of the launched ranks under ``root`` (the processes whose environment has RANK and
    LOCAL_RANK: the launcher's own processes have neither)."""
    import psutil  # DeepSpeed's own dependency

    found: Dict[int, int] = {}
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if "RANK" not in env or "LOCAL_RANK" not in env:
            continue
        rank = int(env["RANK"])
        # a rank's own subprocesses (compile workers) share its environment: keep the oldest, the rank itself
        if rank not in found or child.create_time() < psutil.Process(found[rank]).create_time():
            found[rank] = child.pid
    return found


def alive(pids: Sequence[int]) -> List[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_rank(cmd: Sequence[str], rank: int, after_step: int, metrics: Path, log: Path, delay: float,
              timeout: float) -> Dict[str, Any]:
    """Run ``cmd``; SIGKILL rank ``rank`` once ``metrics`` logged ``after_step`` (and ``delay`` s passed); wait for
    the launch to end. A launch still running ``timeout`` s after the kill is killed whole and reported."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    result: Dict[str, Any] = {"command": list(cmd), "rank": rank, "after_step": after_step, "log": str(log)}
    try:
        while logged_step(metrics) < after_step:
            if proc.poll() is not None:
                result.update(killed=False, exit_code=proc.returncode,
                              reason=f"the launch ended (exit {proc.returncode}) before step {after_step}")
                return result
            time.sleep(0.2)
        time.sleep(delay)
        ranks = rank_processes(proc.pid)
        if rank not in ranks:
            result.update(killed=False, reason=f"no process of rank {rank} among {sorted(ranks)}")
            return result
        os.kill(ranks[rank], signal.SIGKILL)
        t_kill = time.monotonic()
        result.update(killed=True, ranks_found=len(ranks), killed_at_logged_step=logged_step(metrics))
        try:
            result["exit_code"] = proc.wait(timeout=timeout)
            result["seconds_to_stop"] = round(time.monotonic() - t_kill, 2)
            result["stopped"] = True
        except subprocess.TimeoutExpired:
            result.update(stopped=False, seconds_to_stop=None, exit_code=None,
                          reason=f"still running {timeout:.0f} s after the kill")
        time.sleep(1.0)
        result["ranks_left_alive"] = alive([pid for r, pid in ranks.items() if r != rank])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace").splitlines()
    result["error_lines"] = [l for l in text if l.startswith(("error:", "stopped:"))]
    result["tracebacks"] = sum(l.startswith("Traceback") for l in text)
    result["last_lines"] = text[-15:]
    return result


# ---------------------------------------------------------------------------------------------- route

def route_report(route: Path) -> Dict[str, Any]:
    return read_json(route / "report.json")


def gpu_memory_peaks(csv: Optional[Path]) -> Optional[Dict[str, float]]:
    """``index: GiB``, the most each GPU had in use in ``nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,
    nounits -lms 1000`` samples (MiB), or None without the file."""
    if csv is None or not csv.is_file():
        return None
    peaks: Dict[str, float] = {}
    for line in csv.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit():
            try:
                peaks[fields[0]] = max(peaks.get(fields[0], 0.0), float(fields[1]) / 1024)
            except ValueError:
                continue
    return peaks or None


PLAN_PEAK_TFLOPS, PLAN_MFU = 989.0, 0.3  # upcycle plan's defaults: an H100 SXM's dense bf16 peak, 30 % of it


def route_plan(config: Path, gpus: int, overrides: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """``upcycle plan``'s rows for ``gpus`` ranks: ``stage: {ranks, micro_batch, seq_len, total_gib, wall_minutes}``."""
    from hybridlm.config.errors import ConfigError
    from upcycle.plan import load_route, plan_route, plan_rows, teacher_config_for

    try:
        cfg = load_route(config, overrides)
        plan = plan_route(cfg, teacher_config_for(cfg, None), gpus)
    except ConfigError as e:
        fail(f"upcycle plan of {config}: {e}")
    rows = plan_rows(plan.stages, gpus, PLAN_PEAK_TFLOPS, PLAN_MFU)
    # the minutes from the stage's FLOPs as plan_rows counts them (its hours are rounded to 0.01)
    return {r["stage"]: {"ranks": r["ranks"], "micro_batch": r["micro_batch"], "seq_len": r["seq_len"],
                         "total_gib": r["total_gib"],
                         "wall_minutes": round(p.flops / (p.ranks * PLAN_PEAK_TFLOPS * 1e12 * PLAN_MFU) / 60, 2)}
            for r, p in zip(rows, plan.stages)}


def compare_routes(one: Path, many: Path, rtol: float, atol_cloze: float,
                   memory: Sequence[Optional[Path]] = (None, None), plan_config: Optional[Path] = None,
                   gpus: int = 0, plan_overrides: Sequence[str] = ()) -> Dict[str, Any]:
    a, b = route_report(one), route_report(many)
    ppl_a = {r["model"]: r for r in a.get("perplexity", [])}
    ppl_b = {r["model"]: r for r in b.get("perplexity", [])}
    models = []
    for name in ppl_a:
        if name not in ppl_b:
            models.append({"model": name, "missing_in": str(many)})
            continue
        x, y = ppl_a[name], ppl_b[name]
        row: Dict[str, Any] = {"model": name}
        for key in ("ppl", "ppl_b", "kl", "kl_b"):
            if isinstance(x.get(key), (int, float)) and isinstance(y.get(key), (int, float)):
                row[key] = {"one_gpu": x[key], "several": y[key], "rel_diff": rel(y[key], x[key])}
        for key in ("cloze_acc", "cloze_acc_norm"):
            if isinstance(x.get(key), (int, float)) and isinstance(y.get(key), (int, float)):
                row[key] = {"one_gpu": x[key], "several": y[key], "diff": y[key] - x[key]}
        row["within"] = all(row[k]["rel_diff"] <= rtol for k in ("ppl", "ppl_b") if k in row) and \
            all(abs(row[k]["diff"]) <= atol_cloze for k in ("cloze_acc",) if k in row)
        models.append(row)
    stages_a = {s["stage"]: s for s in a.get("stages", [])}
    stages = []
    for s in b.get("stages", []):
        base = stages_a.get(s["stage"], {})
        row = {"stage": s["stage"], "steps": s.get("steps"), "steps_one_gpu": base.get("steps"),
               "minutes": s.get("minutes"), "minutes_one_gpu": base.get("minutes")}
        if s.get("minutes") and base.get("minutes"):
            row["speedup"] = base["minutes"] / s["minutes"]
        stages.append(row)
    compared = [m for m in models if "within" in m]
    if not compared:
        fail(f"{one}/report.json and {many}/report.json share no model")
    # what upcycle plan expected per rank, beside the most each GPU had in use over the whole route
    planned = None
    if plan_config is not None:
        planned = {"config": str(plan_config), "peak_tflops": PLAN_PEAK_TFLOPS, "mfu": PLAN_MFU,
                   "overrides_several": list(plan_overrides), "one_gpu": route_plan(plan_config, 1, ()),
                   "several": route_plan(plan_config, gpus, plan_overrides)}
    measured = {"one_gpu": gpu_memory_peaks(memory[0]), "several": gpu_memory_peaks(memory[1])}
    return {**header("route"), "one_gpu": str(one), "several": str(many), "rtol": rtol, "atol_cloze": atol_cloze,
            "models": models, "stages": stages, "plan": planned, "gpu_memory_used_peak_gib": measured,
            "within": all(m["within"] for m in compared)}


# ---------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multigpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("scaling", help="train_speed reports at several rank counts")
    s.add_argument("--speed", nargs="+", required=True, metavar="RANKS=JSON")
    s.add_argument("--out", required=True)
    s = sub.add_parser("losses", help="runs' losses against a reference run")
    s.add_argument("--reference", required=True, help="a pretrain.py run directory")
    s.add_argument("--run", nargs="+", required=True, metavar="NAME=RUN_DIR")
    s.add_argument("--after-step", type=int, default=0)
    s.add_argument("--rtol", type=float, default=0.01)
    s.add_argument("--out", required=True)
    s = sub.add_parser("kill", help="kill one rank of a launch mid-run")
    s.add_argument("--rank", type=int, required=True)
    s.add_argument("--after-step", type=int, required=True)
    s.add_argument("--metrics", required=True, help="the run's metrics.jsonl")
    s.add_argument("--delay", type=float, default=0.5, help="seconds after the step is logged")
    s.add_argument("--timeout", type=float, default=180.0, help="seconds the launch may take to stop")
    s.add_argument("--log", required=True, help="the launch's output")
    s.add_argument("--out", required=True)
    s.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the launch command")
    s = sub.add_parser("route", help="a several-GPU route against a one-GPU route")
    s.add_argument("--one", required=True, help="the one-GPU route's folder (its report.json)")
    s.add_argument("--many", required=True, help="the several-GPU route's folder")
    s.add_argument("--rtol", type=float, default=0.01)
    s.add_argument("--atol-cloze", type=float, default=0.02)
    s.add_argument("--memory", nargs=2, default=None, metavar=("ONE_CSV", "MANY_CSV"),
                   help="nvidia-smi samples (index, MiB used) taken during each route")
    s.add_argument("--plan-config", default=None, help="the routes' config: upcycle plan's rows at 1 and --gpus ranks")
    s.add_argument("--gpus", type=int, default=8, help="ranks of the several-GPU route (for the plan)")
    s.add_argument("--plan-override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides the several-GPU route ran with (route.sh's lowered micro-batches)")
    s.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.command == "scaling":
        report = scaling(named_paths(args.speed, "--speed"))
    elif args.command == "losses":
        report = losses(Path(args.reference), named_paths(args.run, "--run"), args.after_step, args.rtol)
    elif args.command == "kill":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            fail("kill: no command after --")
        report = {**header("kill"), **kill_rank(cmd, args.rank, args.after_step, Path(args.metrics), Path(args.log),
                                               args.delay, args.timeout)}
        if not (report.get("killed") and report.get("stopped")):
            write_json(Path(args.out), report)
            fail(f"kill: {report.get('reason', 'the launch did not stop')} ({args.out}, {args.log})")
    else:
        memory = [Path(p) for p in args.memory] if args.memory else [None, None]
        report = compare_routes(Path(args.one), Path(args.many), args.rtol, args.atol_cloze, memory,
                                Path(args.plan_config) if args.plan_config else None, args.gpus, args.plan_override)
    write_json(Path(args.out), report)
    return report


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            raise SystemExit(2)
        raise
