"""The SMART report: per-layer KL, sensitivity and choice as JSON, a Markdown table and a bar chart; and the MLA
layers read back from it (:func:`layers_from_report`, for ``upcycle compose --from-smart`` and the route)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from hybridlm.config.errors import ConfigError
from hybridlm.utils.atomic import save_figure, write_json

from hybridlm.config.layers import validate_layers

from .selection import KLValues, _finite, _kl_list

REPORT_JSON = "smart_report.json"
FIG_SIZE_IN = (8.0, 4.5)  # width, height in inches
FIG_DPI = 100  # -> an 800 x 450 pixel PNG
CHOSEN_COLOR = "#d62728"
# the report's title per choice rule (smart_select/selection.py METHODS; "explicit": a given list)
METHOD_TITLES = {"smart": "SMART layer selection", "kl_restore": "KL-restore layer selection (no spacing rule)",
                 "explicit": "Given MLA layers"}
OTHER_COLOR = "#7f7f7f"


def _kv_summary(kv: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    if kv is None:
        return None
    keys = ("ratio", "compression", "teacher_values_per_token", "hybrid_values_per_token",
            "teacher_bytes_per_token", "hybrid_bytes_per_token", "kv_lora_rank", "qk_rope_head_dim", "mla_layers")
    missing = [k for k in ("ratio", "compression") if k not in kv]
    if missing:
        raise ConfigError(f"kv_report: expected the dict returned by hybridlm.kv_report.kv_report, missing {missing}")
    return {k: kv[k] for k in keys if k in kv}


def _kv_text(kv: Optional[Mapping[str, Any]]) -> str:
    if kv is None:
        return ""
    comp = kv["compression"]
    return f"KV cache {100 * kv['ratio']:.2f}% of the teacher" + (f" ({comp:.1f}x smaller)" if comp else "")


def _num(v: float) -> str:
    return f"{v:.6g}"


def write_smart_report(out_dir: Union[str, Path], kl_all: float, kl_per_layer: KLValues, chosen: Sequence[int],
                       kv_report: Optional[Mapping[str, Any]] = None, method: str = "smart") -> Dict[str, Path]:
    """Write ``smart_report.json``, ``smart_report.md`` and ``smart_report.png`` into ``out_dir``.

    ``kl_per_layer[i]`` is KL(teacher || student) with only layer ``i`` as MLA; ``chosen`` the selected
    MLA layers; ``kv_report`` optionally the dict of ``hybridlm.kv_report.kv_report`` for those layers
    (its ratio goes into the title and summary). Returns the three paths by kind (json, md, png).
    """
    kl = _kl_list(kl_per_layer)
    base = _finite("kl_all", kl_all)
    L = len(kl)
    chosen_sorted = validate_layers(list(chosen), None, L)
    chosen_set = set(chosen_sorted)
    sens = [base - v for v in kl]
    kv = _kv_summary(kv_report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    rows = [dict(layer=i, kl=kl[i], sensitivity=sens[i], chosen=i in chosen_set) for i in range(L)]
    payload = dict(num_layers=L, n_mla=len(chosen_sorted), method=method, kl_all=base, chosen=chosen_sorted,
                   sensitivity_sum=sum(sens[i] for i in chosen_sorted), layers=rows, kv=kv)
    paths = dict(json=out / REPORT_JSON, md=out / "smart_report.md", png=out / "smart_report.png")
    write_json(paths["json"], payload)

    lines = [f"# {METHOD_TITLES.get(method, method)}: {len(chosen_sorted)} MLA of {L} layers", "",
             f"KL(teacher || all-Mamba2) = {_num(base)}; sensitivity s_i = KL_all - KL_i (larger = layer i "
             f"helps more as MLA).", "",
             f"Chosen MLA layers: {chosen_sorted} (summed sensitivity {_num(payload['sensitivity_sum'])})."]
    if kv is not None:
        lines += ["", _kv_text(kv) + "."]
    lines += ["", "| layer | KL with layer as MLA | sensitivity | chosen |", "|---:|---:|---:|:---:|"]
    lines += [f"| {r['layer']} | {_num(r['kl'])} | {_num(r['sensitivity'])} | {'yes' if r['chosen'] else ''} |"
              for r in rows]
    paths["md"].write_text("\n".join(lines) + "\n", encoding="utf-8")

    _bar_chart(paths["png"], sens, chosen_set, kv, method)
    return paths


def _bar_chart(path: Path, sens: Sequence[float], chosen: set, kv: Optional[Mapping[str, Any]],
               method: str = "smart") -> None:
    # An explicit Agg canvas: no global backend switch, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    L = len(sens)
    fig = Figure(figsize=FIG_SIZE_IN, dpi=FIG_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = [CHOSEN_COLOR if i in chosen else OTHER_COLOR for i in range(L)]
    ax.bar(range(L), sens, color=colors, edgecolor="black", linewidth=0.4)
    top = max([abs(v) for v in sens] + [1e-12])
    for i in sorted(chosen):  # a marker above (or below, for negative bars) each chosen layer
        y = sens[i] + (0.04 * top if sens[i] >= 0 else -0.04 * top)
        ax.plot([i], [y], marker="v" if sens[i] >= 0 else "^", color=CHOSEN_COLOR, markersize=7)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(range(L))
    ax.tick_params(axis="x", labelsize=7 if L > 24 else 9)
    ax.set_xlim(-0.6, L - 0.4)
    lo, hi = min(sens + [0.0]), max(sens + [0.0])
    pad = 0.12 * (hi - lo if hi > lo else 1.0)
    ax.set_ylim(lo - (pad if lo < 0 else 0), hi + pad)
    ax.set_xlabel("layer")
    ax.set_ylabel("sensitivity  KL_all - KL_i")
    title = f"{METHOD_TITLES.get(method, method)}: N = {len(chosen)} MLA of {L} layers"
    if kv is not None:
        comp = kv["compression"]
        title += f", KV {100 * kv['ratio']:.2f}%" + (f" ({comp:.1f}x)" if comp else "")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=CHOSEN_COLOR, label="chosen (MLA)"), Patch(color=OTHER_COLOR, label="Mamba2")],
              loc="best", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=FIG_DPI)


def layers_from_report(path: Union[str, Path]) -> Tuple[List[int], Optional[int]]:
    """(the chosen MLA layers, num_layers) of a ``smart_report.json`` (or a directory holding one)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / REPORT_JSON
    if not p.is_file():
        raise ConfigError(f"--from-smart: {p} does not exist (expected the {REPORT_JSON} of `upcycle smart`)")
    try:
        rep = json.loads(p.read_text(encoding="utf-8"))
        chosen = rep["chosen"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--from-smart: {p} is not a SMART report ({type(e).__name__}: {e})") from None
    if not isinstance(chosen, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in chosen):
        raise ConfigError(f"--from-smart: {p}: 'chosen' is not a list of layer indices")
    n = rep.get("num_layers")
    return chosen, n if isinstance(n, int) else None


__all__ = ["write_smart_report", "layers_from_report", "REPORT_JSON", "FIG_SIZE_IN", "FIG_DPI"]
