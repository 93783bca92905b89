"""The config schema (hybridlm/config/structured.py): field types and declared ranges are checked in one place,
for sections read from YAML and for sections built in code alike."""
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest

from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, build_dataclass, setting
from hybridlm.data import DataConfig
from hybridlm.engine import OptimConfig
from hybridlm.training import RunConfig


@dataclass
class Example(Section):
    steps: int = setting(1, ge=1)
    rate: float = setting(0.5, gt=0, lt=1)
    share: float = setting(0.5, ge=0, le=1)
    mode: str = setting("a", choices=("a", "b"))
    name: str = setting("x", nonempty="a name")
    cap: Optional[int] = setting(None, ge=1)
    pair: Tuple[float, float] = (0.1, 0.2)
    free: int = 0


@pytest.mark.parametrize("values,message", [
    ({"steps": 0}, "ex.steps: expected an integer >= 1, got 0"),
    ({"steps": True}, "ex.steps: expected an integer, got True"),
    ({"steps": 2.5}, "ex.steps: expected an integer, got 2.5"),
    ({"rate": 1}, "ex.rate: expected a number strictly between 0 and 1, got 1.0"),
    ({"rate": "nan"}, "ex.rate: expected a number strictly between 0 and 1, got nan"),
    ({"share": 1.5}, "ex.share: expected a number in [0, 1], got 1.5"),
    ({"mode": "c"}, "ex.mode: expected one of 'a', 'b', got 'c'"),
    ({"name": "  "}, "ex.name: expected a name, got '  '"),
    ({"cap": 0}, "ex.cap: expected an integer >= 1, got 0"),
    ({"pair": "x"}, "ex.pair: expected a list, got 'x'"),
    ({"nope": 1}, "ex: unknown key 'nope'"),
])
def test_a_bad_value_is_one_line_naming_the_key(values, message):
    with pytest.raises(ConfigError) as e:
        build_dataclass(Example, values, "ex")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_good_values_are_coerced_and_kept():
    ex = build_dataclass(Example, {"steps": 3.0, "rate": "3e-1", "share": 1, "cap": None, "pair": [1, 0]}, "ex")
    assert (ex.steps, ex.rate, ex.share, ex.cap, ex.pair) == (3, 0.3, 1.0, None, (1.0, 0.0))
    assert isinstance(ex.steps, int) and isinstance(ex.share, float)


def test_a_section_built_in_code_meets_the_same_schema():
    with pytest.raises(ConfigError, match=r"^run\.keep_last: expected an integer >= 1, got 0$"):
        RunConfig(keep_last=0).validate("run")
    with pytest.raises(ConfigError, match=r"^optim\.eps: expected a number > 0, got -1\.0$"):
        OptimConfig(micro_batch_size=1, global_batch_size=1, lr=1e-3, max_steps=1, eps=-1.0).validate()
    with pytest.raises(ConfigError, match=r"^data\.txt_split: expected one of 'file', 'paragraphs', got 'lines'$"):
        DataConfig(path="d", txt_split="lines").validate()
    cfg = OptimConfig(micro_batch_size=1, global_batch_size=2, lr=1e-3, max_steps=1, betas=[0.8, 0.9])
    cfg.validate()
    assert cfg.betas == (0.8, 0.9)  # coerced to the declared tuple


def test_cross_field_rules_stay_with_the_section():
    base = {"micro_batch_size": 2, "global_batch_size": 8, "lr": 1e-3, "max_steps": 10}
    with pytest.raises(ConfigError, match=r"optim\.warmup_steps: expected at most max_steps=10"):
        build_dataclass(OptimConfig, {**base, "warmup_steps": 11}, "optim")
    with pytest.raises(ConfigError, match=r"optim\.betas: expected two numbers in \[0, 1\)"):
        build_dataclass(OptimConfig, {**base, "betas": [0.9, 0.95, 0.99]}, "optim")
