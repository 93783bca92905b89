"""``upcycle run``: the whole route, each stage skipped when its output is complete.

init (SVD MLA + MambaInLlama students) -> ILD of both -> SMART layer choice -> compose -> KD -> DPO.
A route config names the teacher, one ``output_dir`` and a section per stage; each training section holds
that stage's ``data`` / ``optim`` / ``run`` (and ``kd`` / ``dpo``) settings, as in the single-stage configs.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Dict

from distill.dpo_stage import DPOConfig, PreferenceDataConfig, run_dpo
from distill.kd import KDConfig, kd_data, run_kd
from distill.stage import run_ild
from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import build_dataclass, check_known_keys
from hybridlm.data import DataConfig
from hybridlm.data.sft import SFTDataConfig
from hybridlm.engine import OptimConfig, barrier, init_distributed
from hybridlm.training import RunConfig
from hybridlm.utils.atomic import write_json
from upcycle.compose import compose_from_dirs
from upcycle.init_students import init_students
from upcycle.route_progress import RouteProgress, training_plan
from upcycle.route_report import route_report
from upcycle.smart_stage import layers_from_report, run_smart

ROUTE_SECTIONS = ("output_dir", "teacher", "init", "ild", "smart", "kd", "dpo", "report")


def _stage_sections(section: Dict[str, Any], where: str, **fixed) -> Dict[str, Any]:
    check_known_keys(where, section, ("data", "optim", "run", "kd", "dpo"))
    out = {k: dict(v or {}) for k, v in section.items()}
    for key, value in fixed.items():
        name, _, field = key.partition("__")
        out.setdefault(name, {})[field] = value
    return out


SMART_KEYS = ("n_mla", "layers", "batches", "batch_size")


def check_route(cfg: Dict[str, Any], stages: Dict[str, Dict[str, Any]]) -> None:
    """Every section of the route, before the first stage starts: a typo in ``dpo.optim`` must not surface
    after init, both ILD runs, SMART and KD have finished."""


    params = inspect.signature(init_students).parameters
    check_known_keys("init", cfg.get("init") or {},
               [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n != "overwrite"])
    check_known_keys("smart", cfg.get("smart") or {}, SMART_KEYS)
    data_classes = {"ild": DataConfig, "kd": SFTDataConfig, "dpo": PreferenceDataConfig}
    own = {"kd": ("kd", KDConfig), "dpo": ("dpo", DPOConfig)}
    for name, sections in stages.items():
        check_known_keys(name, {k: v for k, v in sections.items() if k not in ("teacher", "student")},
                   ("data", "optim", "run") + ((own[name][0],) if name in own else ()))
        data_class, data = data_classes[name], sections.get("data") or {}
        if name == "kd":
            data_class, _, data = kd_data(data)
        build_dataclass(data_class, data, f"{name}.data")
        build_dataclass(OptimConfig, sections.get("optim") or {}, f"{name}.optim")
        build_dataclass(RunConfig, sections.get("run") or {}, f"{name}.run").validate(f"{name}.run")
        if name in own:
            key, cls = own[name]
            build_dataclass(cls, sections.get(key) or {}, f"{name}.{key}")


def run_route(cfg: Dict[str, Any]) -> Dict[str, Any]:
    if not isinstance(cfg.get("output_dir"), str) or not cfg["output_dir"]:
        raise ConfigError("output_dir: expected the directory the route writes every stage into")
    out = Path(cfg["output_dir"])
    teacher = cfg.get("teacher") or "asset:smollm2"
    init_opts = dict(cfg.get("init") or {})
    linear = init_opts.get("linear_mixer", "mamba2")
    report_opts = dict(cfg.get("report") or {})
    check_known_keys("report", report_opts, ("seq_len", "max_tokens", "heldout_sources", "targets", "cloze_items"))
    ild = cfg.get("ild") or {}
    hybrid = out / "hybrid"
    stages = {
        "ild": _stage_sections(ild, "ild", teacher__path=teacher, run__output_dir=str(out / "ild_mla")),
        "kd": _stage_sections(cfg.get("kd") or {}, "kd", teacher__path=teacher, student__path=str(hybrid),
                              run__output_dir=str(out / "kd")),
        "dpo": _stage_sections(cfg.get("dpo") or {}, "dpo", student__path=str(out / "kd" / "final"),
                               run__output_dir=str(out / "dpo")),
    }
    check_route(cfg, stages)
    dist = init_distributed()
    ild_plans = {f"ild_{k}": training_plan("ild", {**stages["ild"], "run": {**stages["ild"]["run"],
                                                                              "output_dir": str(out / f"ild_{k}")}})
                 for k in ("mla", linear)}
    progress = RouteProgress({"init": None, **ild_plans, "smart": None, "compose": None,
                              "kd": training_plan("kd", stages["kd"]), "dpo": training_plan("dpo", stages["dpo"]),
                              "report": None}, enabled=dist.rank == 0)
    summary: Dict[str, Any] = {"teacher": teacher}
    if dist.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "route_config.json", cfg, default=str)

    init_dir = out / "init"
    progress.start("init")
    if dist.rank == 0 and not (init_dir / "init_report.json").is_file():
        init_students(teacher, init_dir, overwrite=True, **init_opts)
    barrier()
    summary["init"] = json.loads((init_dir / "init_report.json").read_text())

    for kind in ("mla", linear):
        progress.start(f"ild_{kind}")
        summary[f"ild_{kind}"] = run_ild(_stage_sections(
            ild, "ild", teacher__path=teacher, student__path=str(init_dir / f"{kind}_student"),
            run__output_dir=str(out / f"ild_{kind}")))
        progress.finished(f"ild_{kind}", summary[f"ild_{kind}"])

    smart = dict(cfg.get("smart") or {})
    smart_dir = out / "smart"
    progress.start("smart")
    if dist.rank == 0 and not (smart_dir / "smart_report.json").is_file():
        data_cfg = build_dataclass(DataConfig, (ild.get("data") or {}), "ild.data")
        run_smart(teacher, out / "ild_mla" / "final", out / f"ild_{linear}" / "final", data_cfg,
                  n_mla=smart.get("n_mla"), layers=smart.get("layers"), out_dir=smart_dir,
                  batches=smart.get("batches", 8), batch_size=smart.get("batch_size", 4))
    barrier()
    chosen, _ = layers_from_report(smart_dir)
    summary["smart"] = {"mla_layers": chosen}

    progress.start("compose")
    if dist.rank == 0 and not (hybrid / "config.json").is_file():
        compose_from_dirs(out / "ild_mla" / "final", out / f"ild_{linear}" / "final", chosen, hybrid,
                          overwrite=True)
    barrier()

    for name, run_stage in (("kd", run_kd), ("dpo", run_dpo)):
        progress.start(name)
        summary[name] = run_stage(stages[name])
        progress.finished(name, summary[name])
    progress.start("report")
    if dist.rank == 0:
        ild_data = build_dataclass(DataConfig, (ild.get("data") or {}), "ild.data")
        summary["report"] = route_report(out, ild_data.path, device=dist.device, **report_opts)
        write_json(out / "route.json", summary, default=str)
        print(f"route finished: {out / 'route.json'}", flush=True)
    barrier()
    return summary
