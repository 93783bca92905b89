"""Plot-able training logs: JSONL (one object per step) + TensorBoard, and a loss-curve PNG.

Only the main rank writes; a non-finite value (a skipped step's loss) is written as null. On resume, entries
after the resumed step are dropped (JSONL rewritten, TensorBoard purged) so a curve never shows the steps a
killed run repeated.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from hybridlm.utils.atomic import json_text, save_figure


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a kill mid-write
                continue
    return out


class MetricsLogger:
    def __init__(self, log_dir: Path, enabled: bool, resume_step: int = 0, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(log_dir) / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json_text(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(Path(log_dir) / "tensorboard"), purge_step=resume_step + 1)
            except ImportError:  # tensorboard is a dependency, but logging must never kill a run
                self.tb = None

    def log(self, step: int, values: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json_text(record) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v  # a non-finite float is written as null (json_text)


def plot_curves(records: Iterable[Dict[str, Any]], png: Path, keys=("loss", "val_loss"), title: str = "") -> Optional[Path]:
    """Loss-vs-step PNG of whichever of ``keys`` the records hold."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for key in keys:
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=key)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png)
    save_figure(fig, png, dpi=120)
    return png
