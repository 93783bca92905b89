"""``upcycle run``: the whole route, each stage skipped when its output is complete.

init (SVD MLA + MambaInLlama students) -> ILD of both -> SMART layer choice -> compose -> [align] -> [sample] -> KD
-> [long_context] -> DPO (``align``: hidden-state alignment of the composed hybrid, run when the config has an
``align:`` section; ``sample``: the teacher's sampled continuations, a data source KD's mix can name, run when there
is a ``sample:`` section, distill/teacher_samples.py; ``long_context``: a second KD stage at a longer sequence length,
usually on windows inside one document (``data.format: documents``), run when the config has a ``long_context:``
section; DPO then starts from it).
A route config names the teacher, one ``output_dir`` and a section per stage; each training section holds
that stage's ``data`` / ``optim`` / ``run`` (and ``kd`` / ``dpo``) settings, as in the single-stage configs.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, Optional

from distill.align import align_configs, run_align
from distill.dpo_stage import dpo_configs, run_dpo
from distill.kd import kd_configs, run_kd
from distill.stage import ild_configs, run_ild
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

ROUTE_SECTIONS = ("output_dir", "teacher", "init", "ild", "smart", "align", "sample", "kd", "long_context", "dpo",
                  "report")


# each training stage's one schema (its module's *_configs), used here to check the route before it starts
STAGE_CONFIGS = {"ild": ild_configs, "align": align_configs, "kd": kd_configs, "long_context": kd_configs,
                 "dpo": dpo_configs}


def _stage_sections(section: Dict[str, Any], where: str, **fixed) -> Dict[str, Any]:
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(section).__name__}")
    out = {k: dict(v or {}) for k, v in section.items()}
    for key, value in fixed.items():
        name, _, field = key.partition("__")
        out.setdefault(name, {})[field] = value
    return out


def ild_sections(built: Dict[str, Any], student: Path, output_dir: Path) -> Dict[str, Any]:
    """One of the route's two ILD runs: a copy of the checked ILD sections (a stage may fill in its data
    section, e.g. the tokenizer) with that run's student and output directory."""
    configs = copy.deepcopy(built)
    configs["student"].path, configs["run"].output_dir = str(student), str(output_dir)
    return configs


def check_route(stages: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Every training section of the route built through its stage's own schema, before the first stage starts:
    a typo in ``dpo.optim`` must not surface after init, both ILD runs, SMART and KD have finished."""
    return {name: STAGE_CONFIGS[name](sections, f"{name}.") for name, sections in stages.items()}


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
    ild = cfg.get("ild") or {}
    hybrid = out / "hybrid"
    stages = {
        "ild": _stage_sections(ild, "ild", teacher__path=teacher, student__path=str(out / "init" / "mla_student"),
                               run__output_dir=str(out / "ild_mla")),
    }
    if cfg.get("align"):  # hidden-state alignment of the composed hybrid, before KD (an empty section: none)
        stages["align"] = _stage_sections(cfg["align"], "align", teacher__path=teacher, student__path=str(hybrid),
                                          run__output_dir=str(out / "align"))
    kd_student = out / "align" / "final" if "align" in stages else hybrid
    stages["kd"] = _stage_sections(cfg.get("kd") or {}, "kd", teacher__path=teacher, student__path=str(kd_student),
                                   run__output_dir=str(out / "kd"))
    if cfg.get("long_context"):  # KD again at a longer sequence length (an empty section: none)
        stages["long_context"] = _stage_sections(cfg["long_context"], "long_context", teacher__path=teacher,
                                                 student__path=str(out / "kd" / "final"),
                                                 run__output_dir=str(out / "long_context"))
    dpo_student = out / ("long_context" if "long_context" in stages else "kd") / "final"
    stages["dpo"] = _stage_sections(cfg.get("dpo") or {}, "dpo", student__path=str(dpo_student),
                                    run__output_dir=str(out / "dpo"))
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
    ild_runs = {kind: ild_sections(built["ild"], init_dir / f"{kind}_student", out / f"ild_{kind}")
                for kind in ("mla", linear)}
    ild_plans = {f"ild_{kind}": training_plan("ild", configs) for kind, configs in ild_runs.items()}
    align_plan = {"align": training_plan("align", built["align"])} if "align" in built else {}
    sample_plan = {"sample": None} if samples else {}
    long_plan = ({"long_context": training_plan("long_context", built["long_context"])}
                 if "long_context" in built else {})
    progress = RouteProgress({"init": None, **ild_plans, "smart": None, "compose": None, **align_plan, **sample_plan,
                              "kd": training_plan("kd", built["kd"]), **long_plan,
                              "dpo": training_plan("dpo", built["dpo"]),
                              "report": None}, enabled=dist.rank == 0)
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

    for kind in ("mla", linear):
        start(f"ild_{kind}")
        summary[f"ild_{kind}"] = run_ild(ild_runs[kind])
        progress.finished(f"ild_{kind}", summary[f"ild_{kind}"])

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

    for name, run_stage in (("align", run_align), ("kd", run_kd), ("long_context", run_kd), ("dpo", run_dpo)):
        if name not in built:
            continue
        if name == "kd" and samples is not None:  # the teacher's continuations, before the KD mix that names them
            start("sample")
            summary["sample"] = sample(samples, teacher)
        start(name)
        summary[name] = run_stage(built[name])
        progress.finished(name, summary[name])
    start("report")
    if dist.rank == 0:
        summary["report"] = route_report(out, ild_data.path, device=dist.device, **report_opts)
        write_json(out / "route.json", summary, default=str)
        print(f"route finished: {out / 'route.json'}", flush=True)
    barrier()
    return summary
