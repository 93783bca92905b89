"""``upcycle run``: the whole route, each stage skipped when its output is complete.

init (SVD MLA + MambaInLlama students) -> ILD of both -> SMART layer choice -> compose -> [align] -> [sample] -> KD
-> [long_context] -> DPO (``align``: hidden-state alignment of the composed hybrid, run when the config has an
``align:`` section; ``sample``: the teacher's sampled continuations, a data source KD's mix can name, run when there
is a ``sample:`` section, distill/teacher_samples.py; ``long_context``: a second KD stage at a longer sequence length,
usually on windows inside one document (``data.format: documents``), run when the config has a ``long_context:``
section; DPO then starts from it).
A route config names the teacher, one ``output_dir`` and a section per stage; each training section holds
that stage's ``data`` / ``optim`` / ``run`` (and ``kd`` / ``dpo``) settings, as in the single-stage configs. The
training stages, their order and where each runs are their declarations' (upcycle/stages.py); init, SMART,
compose, the teacher's samples and the report are the route's own steps.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from distill.teacher_samples import SampleConfig, sample
from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import build_dataclass, check_known_keys
from hybridlm.data import ensure_prepared
from hybridlm.engine import barrier, init_distributed
from hybridlm.teacher import load_teacher_tokenizer
from hybridlm.training.shell import RunShell
from hybridlm.utils.atomic import write_json
from smart_select.report import layers_from_report
from smart_select.stage import SmartConfig, run_smart
from upcycle.compose import compose_from_dirs
from upcycle.init_students import InitConfig, init_students
from upcycle.route_inputs import check_route_inputs
from upcycle.route_progress import RouteProgress, training_plan
from upcycle.route_report import route_report, ruler_options
from upcycle.stages import check_route, hybrid_stages, hybrid_steps, pure_stages, route_stage_sections


def route_sections() -> Tuple[str, ...]:
    """The sections of a route config: its own, the fixed steps' and every registered training stage's, in the
    route's order."""
    steps = hybrid_steps(hybrid_stages(), samples=True)
    if "sample" not in steps:  # a section every route config may hold, even with no stage reading it
        steps.append("sample")
    return ("output_dir", "teacher", "init", *(s.name for s in pure_stages()), "smart", *steps, "report")


def pure_run_sections(built: Dict[str, Any], student: Path, output_dir: Path) -> Dict[str, Any]:
    """One of a pure stage's two runs (ILD of each student): a copy of the checked sections (a stage may fill in
    its data section, e.g. the tokenizer) with that run's student and output directory."""
    configs = copy.deepcopy(built)
    configs["student"].path, configs["run"].output_dir = str(student), str(output_dir)
    return configs


def prepare_calibration_data(ild_data, teacher: str, calib_sources, rank: int) -> None:
    """Init calibrates on ``init.calib_sources``; where one of them is the ILD data, it is prepared (with the
    teacher's tokenizer, as the ILD stage would) before init, on rank 0."""
    if rank == 0 and str(Path(ild_data.path)) in {str(Path(s)) for s in calib_sources or ()}:
        data = copy.deepcopy(ild_data)
        if data.tokenizer == "teacher":
            data.tokenizer = str(Path(load_teacher_tokenizer(teacher).name_or_path))
        ensure_prepared(data, "ild.data")
    barrier()


def run_route(cfg: Dict[str, Any]) -> Dict[str, Any]:
    if not isinstance(cfg.get("output_dir"), str) or not cfg["output_dir"]:
        raise ConfigError("output_dir: expected the directory the route writes every stage into")
    out = Path(cfg["output_dir"])
    teacher = cfg.get("teacher") or "asset:smollm2"
    init_cfg = build_dataclass(InitConfig, cfg.get("init") or {}, "init")
    smart_cfg = build_dataclass(SmartConfig, cfg.get("smart") or {}, "smart")
    linear = init_cfg.linear_mixer
    report_opts = dict(cfg.get("report") or {})
    check_known_keys("report", report_opts, ("seq_len", "max_tokens", "heldout_sources", "targets", "cloze_items",
                                             "generation_prompts", "generation_tokens", "generation_prompt_tokens",
                                             "ruler_lengths", "ruler_items", "ruler_tasks"))
    if report_opts.get("ruler_lengths"):  # checked now, not after the last stage
        ruler_options(report_opts["ruler_lengths"], report_opts.get("ruler_items", 5),
                      report_opts.get("ruler_tasks", ("all",)))
    stages = route_stage_sections(cfg, out, teacher)
    built = check_route(stages)
    samples = sample_section(cfg, out, built)
    calib = [init_cfg.calib_sources] if isinstance(init_cfg.calib_sources, str) else list(init_cfg.calib_sources)
    check_route_inputs(teacher, built, calib, report_opts.get("heldout_sources"),
                       produced=[samples.out] if samples else ())
    with RunShell(out, what="output_dir"):  # every stage below runs in it: one lock, the signals, from start to exit
        return _run_stages(cfg, out, teacher, init_cfg, smart_cfg, linear, report_opts, built, calib, samples)


def sample_section(cfg: Dict[str, Any], out: Path, built: Dict[str, Any]) -> Optional[SampleConfig]:
    """The route's ``sample:`` section, its prompts defaulting to the ILD data and its output to
    ``output_dir/samples``; None without one."""
    section = cfg.get("sample")
    if not section:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"sample: expected a mapping, got {type(section).__name__}")
    values = {"prompts": built["ild"]["data"].path, "out": str(out / "samples"), **section}
    return build_dataclass(SampleConfig, values, "sample")


def _run_stages(cfg, out: Path, teacher: str, init_cfg, smart_cfg, linear: str, report_opts, built, calib,
                samples: Optional[SampleConfig]):
    hybrid = out / "hybrid"
    dist = init_distributed()
    for name, configs in built.items():  # the one check that needs the world size, before the first stage
        configs["optim"].gradient_accumulation_steps(dist.world_size, f"{name}.optim")
    ild_data = built["ild"]["data"]
    init_dir = out / "init"
    # a pure stage (ILD) trains each of init's two students; the hybrid stages after compose, one after another
    pure_runs = {f"{spec.name}_{kind}": (spec, pure_run_sections(built[spec.name], init_dir / f"{kind}_student",
                                                                  out / f"{spec.name}_{kind}"))
                 for spec in pure_stages() if spec.name in built for kind in ("mla", linear)}
    hybrid_runs = {spec.name: spec for spec in hybrid_stages() if spec.name in built}
    after_compose = hybrid_steps(list(hybrid_runs.values()), samples=bool(samples))
    steps: Dict[str, Any] = {"init": None}
    steps.update({name: training_plan(spec.name, configs) for name, (spec, configs) in pure_runs.items()})
    steps.update({"smart": None, "compose": None})
    steps.update({name: None if name == "sample" else training_plan(name, built[name]) for name in after_compose})
    steps["report"] = None
    progress = RouteProgress(steps, enabled=dist.rank == 0)
    summary: Dict[str, Any] = {"teacher": teacher}

    def start(stage: str) -> None:  # a safe point: a signal stops the route here, the stages before it complete
        RunShell.check(f"before the route's {stage} stage (the stages before it are complete)")
        progress.start(stage)

    if dist.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "route_config.json", cfg, default=str)

    start("init")
    prepare_calibration_data(ild_data, teacher, calib, dist.rank)
    if dist.rank == 0 and not (init_dir / "init_report.json").is_file():
        init_students(init_cfg, teacher, init_dir, overwrite=True)
    barrier()
    summary["init"] = json.loads((init_dir / "init_report.json").read_text())

    for name, (spec, configs) in pure_runs.items():
        start(name)
        summary[name] = spec.run(configs)
        progress.finished(name, summary[name])

    smart_dir = out / "smart"
    start("smart")
    # every rank measures its share of the calibration batches; rank 0 writes the report only after the ranks'
    # sums are added, so each rank has looked for a finished report before any can be written
    if not (smart_dir / "smart_report.json").is_file():
        run_smart(smart_cfg, teacher, out / "ild_mla" / "final", out / f"ild_{linear}" / "final", ild_data, smart_dir,
                  dist=dist)
    barrier()
    mla_layers, _ = layers_from_report(smart_dir)
    summary["smart"] = {"mla_layers": mla_layers}

    start("compose")
    if dist.rank == 0 and not (hybrid / "config.json").is_file():
        compose_from_dirs(out / "ild_mla" / "final", out / f"ild_{linear}" / "final", mla_layers, hybrid,
                          overwrite=True)
    barrier()

    for name in after_compose:
        start(name)
        if name == "sample":  # the teacher's continuations, before the first mix that names them
            summary["sample"] = sample(samples, teacher)
            continue
        summary[name] = hybrid_runs[name].run(built[name])
        progress.finished(name, summary[name])
    start("report")
    if dist.rank == 0:
        summary["report"] = route_report(out, ild_data.path, device=dist.device, **report_opts)
        write_json(out / "route.json", summary, default=str)
        print(f"route finished: {out / 'route.json'}", flush=True)
    barrier()
    return summary
