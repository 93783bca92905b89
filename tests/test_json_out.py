"""The project's one JSON writer: strict JSON, a non-finite float written as null, atomic replacement."""
import json
import math
from pathlib import Path

import pytest

from hybridlm.utils.atomic import finite_or_none, json_text, write_json


def strict_loads(text: str):
    """json.loads that rejects the NaN / Infinity / -Infinity tokens Python's json accepts by default."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_become_null_at_any_depth():
    value = {"loss": float("nan"), "ppl": float("inf"), "low": -math.inf, "ok": 1.5, "n": 3, "flag": True,
             "rows": [{"kl": float("nan")}, (2.0, float("-inf"))], "name": "NaN", "none": None}
    text = json_text(value)
    assert strict_loads(text) == {"loss": None, "ppl": None, "low": None, "ok": 1.5, "n": 3, "flag": True,
                                  "rows": [{"kl": None}, [2.0, None]], "name": "NaN", "none": None}
    assert "NaN" not in text.replace('"NaN"', "") and "Infinity" not in text
    assert finite_or_none(float("nan")) is None and finite_or_none(0.25) == 0.25
    # what `default` makes of an unknown object is made finite too
    assert strict_loads(json_text({"p": Path("a"), "x": object()}, default=lambda o: str(o) if isinstance(o, Path)
                                  else float("nan"))) == {"p": "a", "x": None}
    with pytest.raises(TypeError):  # without `default`, an unknown object is still an error
        json_text({"x": object()})


def test_write_json_is_strict_and_atomic(tmp_path):
    path = tmp_path / "deep" / "result.json"
    write_json(path, {"final_train_loss": float("nan"), "steps": 8})
    assert strict_loads(path.read_text(encoding="utf-8")) == {"final_train_loss": None, "steps": 8}
    assert path.read_text().endswith("\n")
    write_json(path, {"steps": 9, "text": "é"}, ensure_ascii=False)  # replaces it; UTF-8 on every locale
    assert strict_loads(path.read_text(encoding="utf-8")) == {"steps": 9, "text": "é"}
    with pytest.raises(TypeError):  # a failed encoding leaves the old file and no temporary behind
        write_json(path, {"x": object()})
    assert strict_loads(path.read_text(encoding="utf-8"))["steps"] == 9
    assert sorted(p.name for p in path.parent.iterdir()) == ["result.json"]


def test_metrics_log_writes_a_skipped_steps_nan_loss_as_null(tmp_path):
    from hybridlm.utils.metrics import MetricsLogger, plot_curves, read_jsonl
    log = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    log.log(1, {"loss": 2.0})
    log.log(2, {"loss": float("nan"), "skipped": 1})
    log.close()
    rows = [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": None, "skipped": 1}]
    MetricsLogger(tmp_path, enabled=True, resume_step=2, tensorboard=False).close()  # resume rewrites the file
    assert read_jsonl(tmp_path / "metrics.jsonl") == rows
    assert plot_curves(rows, tmp_path / "c.png") is not None  # a null loss is left out of the curve
