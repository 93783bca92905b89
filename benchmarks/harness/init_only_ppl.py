"""The route's "hybrid, init only" row for one route config, without its training stages: ``upcycle init`` (both
students, the linear one calibrated), the hybrid composed with given MLA layers, perplexity and KL(teacher ||
hybrid) on the route report's held-out text (a), and each linear mixer's relative output error against the
teacher's attention before and after calibration (from ``init_report.json``).

    python -m benchmarks.harness.init_only_ppl --config configs/upcycle/smollm2_gdn_route_cpu.yaml \
        --work runs/init_only_gdn --out docs/results/upcycling/gdn_init_only.json

The same code paths as ``upcycle run`` and ``upcycle report``: :func:`upcycle.init_students.init_students`,
:func:`upcycle.compose.compose_from_dirs`, :func:`upcycle.route_report.score` over
:func:`hybridlm.data.packed.heldout_windows` of the ILD data. The MLA layers are fixed (default: SMART's choice on
the GPU route) so that two linear mixers are compared on the same hybrid layout; the route itself takes SMART's
choice on its own ILD students. ``--work`` keeps the students: a rerun reuses them.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.harness.init_variants import ROUTE_MLA_LAYERS
from hybridlm.config.loader import load_config
from hybridlm.config.structured import build_dataclass
from hybridlm.data.packed import heldout_windows
from hybridlm.model import HybridForCausalLM
from hybridlm.teacher import load_teacher
from hybridlm.utils.atomic import write_json
from upcycle.compose import compose_from_dirs
from upcycle.init_students import InitConfig, init_students
from upcycle.route import prepare_calibration_data, route_sections
from upcycle.stages import check_route, stage_sections
from upcycle.route_report import score


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a route config (upcycle run --config)")
    p.add_argument("--work", required=True, help="where the students and the composed hybrid are written")
    p.add_argument("--mla-layers", default=",".join(map(str, ROUTE_MLA_LAYERS)))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--out", default=None, help="JSON of the result (default: WORK/init_only.json)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, sections=route_sections())
    teacher_spec = cfg.get("teacher") or "asset:smollm2"
    init_cfg = build_dataclass(InitConfig, cfg.get("init") or {}, "init")
    built = check_route({"ild": stage_sections(cfg.get("ild") or {}, "ild", teacher__path=teacher_spec,
                                               student__path="unused", run__output_dir="unused")})
    data = built["ild"]["data"]
    prepare_calibration_data(data, teacher_spec, [data.path], 0)  # the route's own preparation of its ILD data
    work = Path(args.work)
    t0 = time.perf_counter()
    if not (work / "init" / "init_report.json").is_file():
        init_students(init_cfg, teacher_spec, work / "init", overwrite=True)
    summary = json.loads((work / "init" / "init_report.json").read_text())
    init_seconds = round(time.perf_counter() - t0)
    mla_layers = [int(i) for i in args.mla_layers.split(",") if i.strip()]
    linear = init_cfg.linear_mixer
    hybrid_dir = work / "hybrid_init"
    compose_from_dirs(work / "init" / "mla_student", work / "init" / f"{linear}_student", mla_layers, hybrid_dir,
                      overwrite=True)
    windows = heldout_windows(data.path, args.seq_len, args.max_tokens)
    teacher = load_teacher(teacher_spec, dtype=torch.float32).eval()
    hybrid = HybridForCausalLM.from_pretrained(hybrid_dir).float().eval()
    rows = [{"model": "teacher", **score(teacher, teacher, windows)},
            {"model": "hybrid, init only", **score(hybrid, teacher, windows)}]
    calib = summary.get("calibration") or {}
    layers = {int(i): r for i, r in (calib.get("layers") or {}).items()}
    result = {"config": args.config, "linear_mixer": linear, "mla_layers": mla_layers,
              "held_out": f"{data.path} (validation split)", "seq_len": args.seq_len, "rows": rows,
              "calibration": {k: v for k, v in calib.items() if k != "layers"},
              "hybrid_layers_rel_err": {i: layers[i] for i in sorted(layers) if i not in mla_layers},
              "all_layers_rel_err": {i: layers[i] for i in sorted(layers)}, "init_seconds": init_seconds}
    for r in rows:
        print(f"{r['model']:20s} perplexity {r['ppl']:10.2f}  KL {r['kl']:.4f}  ({r['tokens']} tokens)")
    print("layer  rel. error before -> after calibration")
    for i, r in result["all_layers_rel_err"].items():
        note = "  (MLA in the hybrid)" if i in mla_layers else ""
        print(f"{i:5d}  {r['rel_err_before']:10.4g} -> {r['rel_err_after']:.4f}{note}")
    write_json(Path(args.out) if args.out else work / "init_only.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
