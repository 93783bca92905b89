"""The acceptance run on a CUDA host: every part a subprocess with its own log, one JSON report rewritten after each
part (a run cut short keeps what it finished), and a one-screen summary. ``bash benchmarks/acceptance.sh OUT_DIR``
is the entry point (it checks the host first); this module is its runner and the report's schema.

    python -m benchmarks.acceptance --out OUT_DIR [--parts pretrain route generate gpu_tests] [--commit SHA]

On a fresh H100 with the shipped tuning the whole run is meant to take at most 8 minutes: pre-training about a
minute, the route smoke about a minute (a 4-layer twin), generate()'s matrix 2-3 minutes and the gpu test subset
(:data:`GPU_SUBSET`: each gpu test once, at the parametrization that reaches what only a GPU runs) a few minutes; every `gpu` test is ``bash benchmarks/gpu_tests.sh OUT_DIR``.
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
from typing import Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "hybridlm-acceptance/1"
PARTS = ("pretrain", "route", "generate", "gpu_tests")
# the report's fields and each part's: what tests/test_acceptance.py holds the writer to
REPORT_FIELDS = {"schema": str, "passed": bool, "started": str, "wall_seconds": float, "commit": (str, type(None)),
                 "commit_source": str, "host": dict, "tuning": str, "first_step_seconds": (float, type(None)), "parts": list}
PART_FIELDS = {"name": str, "passed": bool, "seconds": float, "exit_code": int, "log": str, "summary": str,
               "counts": dict}
HOST_FIELDS = ("gpu", "gpus", "python", "torch", "cuda", "triton", "flash-linear-attention", "deepspeed",
               "transformers")


# The gpu_tests part: every test function of the `gpu` suite once (the sublayer and fused-step tests once per mixer
# they name), at the parametrization only a GPU runs (bf16, which the interpreted CI phase leaves out for fla's
# kernels; the "mixed" model, which holds MLA, GDN, KDA and Mamba2 together) and at the route's and the recipes'
# shapes where a test has them: 39 of the suite's 151 tests. tests/test_acceptance.py holds it to the collected
# suite: every id exists, and every gpu test function is here or in GPU_SUBSET_LEAVES with the reason.
_G = "tests/gpu/"
GPU_SUBSET = [
    _G + "test_causal_conv_gpu.py::test_kernels_match_the_twin_and_fla[tiles32-2048-bias-bfloat16]",
    _G + "test_causal_conv_gpu.py::test_split_conv_matches_a_conv_per_block[bfloat16]",
    _G + "test_causal_conv_gpu.py::test_split_conv_with_head_norm_matches_the_twin_and_fla_l2norm[gdn-bfloat16]",
    _G + "test_causal_conv_gpu.py::test_pass1_x_once_matches_the_per_tap_pre_activation[32-16-4-bfloat16]",
    _G + "test_device_step_gpu.py::test_the_engine_steps_on_the_gpu",
    _G + "test_device_step_gpu.py::test_a_nonfinite_step_is_skipped_on_the_gpu",
    _G + "test_device_step_gpu.py::test_steps_train_as_deepspeeds_on_the_gpu",
    _G + "test_fused_training_gpu.py::test_packed_swiglu_matches_the_twin_and_fla[bfloat16]",
    _G + "test_fused_training_gpu.py::test_fused_training_step_matches_the_unfused_one[gdn]",
    _G + "test_fused_training_gpu.py::test_fused_training_step_matches_the_unfused_one[mamba2]",
    _G + "test_generation_gpu.py::test_cached_decode_matches_full_forward[mixed-bfloat16]",
    _G + "test_generation_gpu.py::test_left_padded_batch_decodes_like_each_sequence_alone[mixed]",
    _G + "test_generation_gpu.py::test_static_cache_eager_decode_matches_transformers_loop",
    _G + "test_generation_gpu.py::test_cuda_graph_decode_equals_eager_static_cache[mixed-bfloat16]",
    _G + "test_generation_gpu.py::test_captured_step_with_a_kernel_switch_decodes_like_without_it"
         "[graph_small_kernels-mixed-bfloat16]",
    _G + "test_generation_gpu.py::test_captured_step_with_a_kernel_switch_decodes_like_without_it"
         "[graph_fuse_residual-mixed-bfloat16]",
    _G + "test_generation_gpu.py::test_graphed_generate_equals_its_eager_run[mixed]",
    _G + "test_generation_gpu.py::test_generate_on_cuda_takes_the_graph_path_with_the_same_tokens[mixed]",
    _G + "test_latent_decode_gpu.py::test_kernel_matches_the_twin[route_8k_b1-bfloat16]",
    _G + "test_latent_decode_gpu.py::test_graphed_decode_through_the_kernel_and_through_sdpa[bfloat16]",
    _G + "test_loss_and_norm_kernels_gpu.py::test_rms_norm_matches_the_twin_and_fla[residual-bfloat16]",
    _G + "test_loss_and_norm_kernels_gpu.py::test_gdn_output_norm_matches_the_twin_and_fla[bfloat16]",
    _G + "test_loss_and_norm_kernels_gpu.py::test_mamba2_output_stage_matches_the_twin_and_fla[bfloat16]",
    _G + "test_loss_and_norm_kernels_gpu.py::test_cross_entropy_matches_the_twin_and_fla[bfloat16]",
    _G + "test_loss_and_norm_kernels_gpu.py::test_chunked_loss_with_either_kernel_agrees",
    _G + "test_loss_and_norm_kernels_gpu.py::test_chunked_loss_gradients_match_full_fp32_logits",
    _G + "test_loss_and_norm_kernels_gpu.py::test_kd_divergence_matches_the_twin[tempered_kl_ce-bfloat16]",
    _G + "test_loss_and_norm_kernels_gpu.py::test_chunked_kd_on_the_kernel_equals_the_torch_ops",
    _G + "test_mamba2_step_gpu.py::test_kernel_matches_the_twin[route-bfloat16]",
    _G + "test_mamba2_step_gpu.py::test_a_layer_step_is_two_gemms_and_the_fused_kernel",
    _G + "test_mamba2_step_gpu.py::test_graphed_decode_with_and_without_the_fused_step[xb_repeat-bfloat16]",
    _G + "test_readback_gpu.py::test_readback_waits_for_the_work_before_it_only",
    _G + "test_readback_gpu.py::test_a_stamp_times_the_device_work_between_two_stamps",
    *(_G + f"test_triton_paths.py::test_sublayer_triton_matches_torch[300-{kind}-bfloat16]"
      for kind in ("gdn", "kda", "mamba2", "mla", "mlp")),
    _G + "test_triton_paths.py::test_whole_model_loss_and_grads_match[bfloat16]",
]
# gpu test functions the subset leaves to the whole suite (benchmarks/gpu_tests.sh), and why
GPU_SUBSET_LEAVES = {
    _G + "test_mamba2_compile_gpu.py::test_compiled_inputs_train_like_the_eager_ones":
        "an opt-in path (runtime.compile_ssd_inputs, off by default), torch.compile's minute on a fresh host",
}


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


def _tuned_afresh(log: str) -> Optional[int]:
    """Autotuned launches the shipped tuning lacked, summed over a log's first-step lines (hybridlm/ops/tuning.py
    ``TuningStatus.served``); None where no line says (no CUDA tuning status)."""
    found = re.findall(r"shipped tuning served \d+ autotuned kernels, (\d+) tuned afresh", log)
    return sum(int(n) for n in found) if found else None


def _first_step(log: str, out: Path) -> dict:
    """The pre-training log's first-step line, the launches it tuned afresh and the last logged loss."""
    counts: dict = {}
    afresh = _tuned_afresh(log)
    if afresh is not None:
        counts["tuned_afresh"] = afresh
    m = re.search(r"first step done in ([0-9.]+) s", log)
    if m:
        counts["first_step_seconds"] = float(m.group(1))
    steps = re.findall(r"step (\d+)[^\n]*?loss ([0-9.]+)", log)
    if steps:
        counts["last_step"], counts["last_loss"] = int(steps[-1][0]), float(steps[-1][1])
    counts["summary"] = (f"first step {counts.get('first_step_seconds', '?')} s; step {counts.get('last_step', '?')} "
                         f"loss {counts.get('last_loss', '?')}")
    if afresh is not None:
        counts["summary"] += f"; {afresh} launches tuned afresh"
    return counts


def _route_stages(log: str, out: Path) -> dict:
    stages = [l.split()[3] for l in log.splitlines() if l.startswith("route: stage ")]
    report = out / "route" / "report.json"
    ppl = {}
    if report.is_file():
        ppl = {r["model"]: r["ppl"] for r in json.loads(report.read_text()).get("perplexity", [])}
    counts = {"stages": stages, "ppl": ppl, "summary": f"{len(stages)} stages: {' '.join(stages)}"}
    afresh = _tuned_afresh(log)
    if afresh is not None:
        counts["tuned_afresh"] = afresh
        counts["summary"] += f"; {afresh} launches tuned afresh"
    return counts


# the route smoke's twin: SmolLM2-135M-Instruct's layer shapes (so its kernels launch at the shapes of the route and
# of the shipped tuning), 4 of its 30 layers, 2 of them MLA after SMART
TWIN_LAYERS, TWIN_MLA = 4, 2


def _twin_teacher(out: Path) -> None:
    """A random-weight Llama of SmolLM2-135M-Instruct's layer shapes, ``TWIN_LAYERS`` deep, with the Llama-3.2
    tokenizer (shipped as an asset, so nothing is fetched), saved as the route smoke's teacher."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.route_twin import SMOLLM2
    from hybridlm.data import load_tokenizer
    teacher = out / "teacher"
    if (teacher / "config.json").is_file():
        return
    tok = load_tokenizer("asset:llama3.2")
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SMOLLM2, "vocab_size": len(tok), "num_hidden_layers": TWIN_LAYERS}, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(teacher)
    tok.save_pretrained(teacher)


def parts(out: Path, data: Path, py: str = sys.executable) -> Dict[str, Part]:
    """The acceptance parts, in run order, writing under ``out``; ``data``: Jane Austen's novels prepared with the
    Llama-3.2 tokenizer (benchmarks/common.sh ``prepare_data``)."""
    # the route smoke: every stage, two bf16 steps each at micro-batch 2 x 256 (the shapes tests/support/kernel_keys.py
    # holds the shipped tuning to), calibration on 8 windows of 256 tokens
    steps = ["optim.micro_batch_size=2", "optim.global_batch_size=2", "optim.max_steps=2", "optim.warmup_steps=1",
             "run.progress=false", "run.eval_interval=0", "run.save_interval=0", "data.val_max_batches=1",
             "optim.precision=bf16"]
    route = [f"output_dir={out / 'route'}", f"teacher={out / 'teacher'}", "init.calib_tokens=2048",
             "init.calib_seq_len=256", f"ild.data.path={out / 'route_data'}", f"smart.n_mla={TWIN_MLA}",
             "smart.batches=2", "smart.batch_size=2", "kd.data.max_length=256", "dpo.data.max_length=256",
             "dpo.data.max_prompt_length=128", "report.seq_len=256", "report.max_tokens=2048",
             "report.generation_prompts=1", "report.generation_tokens=16"]
    route += [f"{stage}.{o}" for stage in ("ild", "kd", "dpo") for o in steps]
    # 20 steps of GDN-300M at micro-batch 16 x 2048 (2 accumulated: 32 sequences a step), evaluated at 10 and 20,
    # one checkpoint at the end
    pretrain = ["--config", "configs/experiments/gdn_300m.yaml", f"data.path={data}", "optim.micro_batch_size=16",
                "optim.global_batch_size=32", "optim.max_steps=20", "optim.warmup_steps=5", "run.eval_interval=10",
                "run.save_interval=20", "run.log_interval=1", "data.val_max_batches=2", "run.sample_tokens=16",
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
        "gpu_tests": Part("gpu_tests", [*pytest, "-m", "gpu", "--durations=15", "--junitxml",
                                        str(out / "gpu_tests.xml"), *GPU_SUBSET], 900,
                          read=_pytest_counts(out / "gpu_tests.xml")),
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


def _git(*args: str) -> Optional[subprocess.CompletedProcess]:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None


def tree_commit(given: Optional[str] = None) -> Tuple[Optional[str], str]:
    """(the commit the run's code is, how that is known). ``given`` (``--commit`` / ``HYBRIDLM_COMMIT``: a copy of a
    checkout without its history, or with another's) wins; else ``git rev-parse HEAD`` where the tracked files equal
    HEAD's. A tree that differs from its HEAD (local changes, or git metadata copied from elsewhere) has no commit
    that names it: None, with the reason."""
    if given:
        return given, "given (--commit / HYBRIDLM_COMMIT)"
    head = _git("rev-parse", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return None, "unknown: no git history here (pass --commit or HYBRIDLM_COMMIT)"
    sha = head.stdout.strip()
    changed = _git("status", "--porcelain", "--untracked-files=no")
    if changed is None or changed.returncode != 0:
        return None, f"unknown: git status failed at HEAD {sha[:12]} (pass --commit or HYBRIDLM_COMMIT)"
    files = [l for l in changed.stdout.splitlines() if l.strip()]
    if files:
        return None, (f"unknown: the tree differs from HEAD {sha[:12]} in {len(files)} tracked files (local changes, "
                      "or another checkout's git metadata; pass --commit or HYBRIDLM_COMMIT)")
    return sha, "git rev-parse HEAD (the tracked files equal HEAD's)"


def new_report(host: dict, tuning: str, commit: Optional[str] = None) -> dict:
    sha, source = tree_commit(commit)
    return {"schema": SCHEMA, "passed": False, "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_seconds": 0.0, "commit": sha, "commit_source": source, "host": host, "tuning": tuning,
            "first_step_seconds": None, "parts": []}


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
             f"{h['flash-linear-attention']}, commit {report['commit'] or report['commit_source']})",
             f"  {report['tuning']}"]
    for p in report["parts"]:
        lines.append(f"  {'ok  ' if p['passed'] else 'FAIL'} {p['name']:<10} {p['seconds']:7.1f} s  {p['summary']}")
    if report["first_step_seconds"] is not None:
        lines.append(f"  GDN-300M's first optimizer step: {report['first_step_seconds']:.1f} s")
    return "\n".join(lines)


def run(out: Path, names: List[str], data: Path, tuning: str, commit: Optional[str] = None) -> dict:
    from hybridlm.utils.atomic import write_json
    out.mkdir(parents=True, exist_ok=True)
    table = parts(out, data)
    t0 = time.monotonic()
    report = new_report(host_facts(), tuning, commit)
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
    ap.add_argument("--commit", default=os.environ.get("HYBRIDLM_COMMIT") or None,
                    help="the commit of this code, where the checkout's git metadata cannot say (default: "
                         "$HYBRIDLM_COMMIT, else git rev-parse HEAD of a tree equal to it)")
    args = ap.parse_args(argv)
    report = run(args.out, args.parts, args.data, args.tuning, args.commit)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
