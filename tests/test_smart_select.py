"""SMART layer selection: the rule, DP optimality against brute force, the published 1B picks, the report."""
import itertools
import json
import math
import random

import pytest

from hybridlm.config.errors import ConfigError
from smart_select import (is_valid_selection, select_layers, selection_rule, selection_sum, sensitivities,
                          write_smart_report)
from smart_select.report import FIG_DPI, FIG_SIZE_IN
from hybridlm.kv_report import kv_report, load_teacher_config


def rule_allows(chosen, s, n):
    """The rule restated independently of the implementation (see smart_select.selection's docstring)."""
    L = len(s)
    if n == 0:
        return list(chosen) == []
    if chosen[0] != 0:
        return False
    if n == 1:
        return list(chosen) == [0]
    ends = [e for e in (L - 2, L - 1) if e >= max(1, n - 1)]
    end = ends[0] if len(ends) == 1 else (L - 2 if s[L - 2] >= s[L - 1] else L - 1)
    if chosen[-1] != end:
        return False
    gaps = [b - a for a, b in zip(chosen, chosen[1:])]
    even = end / (n - 1)
    return all(g in (math.floor(even), math.ceil(even)) for g in gaps)


def brute_force(s, n):
    """All feasible selections and the best summed sensitivity among them."""
    feasible = [c for c in itertools.combinations(range(len(s)), n) if rule_allows(c, s, n)]
    best = max(sum(s[i] for i in c) for c in feasible)
    return feasible, best


@pytest.mark.parametrize("L", range(2, 12))
def test_dp_matches_brute_force(L):
    rng = random.Random(L)
    for n in range(0, L + 1):
        for trial in range(6):
            s = [rng.uniform(-1, 1) for _ in range(L)]
            feasible, best = brute_force(s, n)
            got = select_layers(s, n)
            assert tuple(got) in feasible, (L, n, got)
            assert is_valid_selection(got, s, n)
            assert selection_sum(s, got) == pytest.approx(best, abs=1e-12)


def test_dp_ties_go_to_the_lexicographically_smallest_optimum():
    rng = random.Random(0)
    for _ in range(200):
        L = rng.randint(3, 12)
        n = rng.randint(2, L)
        s = [rng.randint(0, 3) for _ in range(L)]  # small integers: many exact ties
        feasible, best = brute_force(s, n)
        optimal = sorted(c for c in feasible if sum(s[i] for i in c) == best)
        assert tuple(select_layers(s, n)) == optimal[0]


def test_published_1b_picks():
    # Early layers matter more; layers 5 and 10 stand out; layer 14 beats 15 as the end.
    s = [2.0 - 0.05 * i for i in range(16)]
    s[5] += 0.5
    s[10] += 0.5
    s[14], s[15] = 1.4, 1.1
    assert select_layers(s, 4) == [0, 5, 10, 14]
    assert select_layers(s, 8) == [0, 2, 4, 6, 8, 10, 12, 14]
    # they are the best-sum feasible sets, and the feasible sets are what the rule says
    for n, picks in ((4, (0, 5, 10, 14)), (8, (0, 2, 4, 6, 8, 10, 12, 14))):
        feasible, best = brute_force(s, n)
        assert sum(s[i] for i in picks) == pytest.approx(best)
    assert sorted(brute_force(s, 4)[0]) == [(0, 4, 9, 14), (0, 5, 9, 14), (0, 5, 10, 14)]
    assert brute_force(s, 8)[0] == [(0, 2, 4, 6, 8, 10, 12, 14)]
    assert selection_rule(s, 4) == dict(first=0, last=14, gap_lo=4, gap_hi=5, n_hi=2)


def test_sensitive_layer_shifts_the_choice_within_the_allowed_gaps():
    base = [1.0] * 16
    base[14] = 1.2
    s = list(base); s[5] = s[10] = 2.0
    assert select_layers(s, 4) == [0, 5, 10, 14]
    s = list(base); s[5] = s[10] = 2.0; s[4] = 10.0  # a very sensitive layer 4 pulls the chain earlier
    assert select_layers(s, 4) == [0, 4, 9, 14]
    s = list(base); s[5] = 3.0; s[9] = 3.0  # 5 and 9 together
    assert select_layers(s, 4) == [0, 5, 9, 14]
    s = list(base); s[7] = 100.0  # unreachable with gaps of 4-5: never chosen
    assert 7 not in select_layers(s, 4)
    s = list(base); s[15] = 5.0  # the end moves to L-1 = 15: gaps 15/3 = 5
    assert select_layers(s, 4) == [0, 5, 10, 15]
    got = select_layers(s, 8)  # 15/7: six gaps of 2, one of 3
    assert got[0] == 0 and got[-1] == 15 and sorted(b - a for a, b in zip(got, got[1:])) == [2] * 6 + [3]


def test_edge_counts():
    s = [0.1 * i for i in range(6)]
    assert select_layers(s, 0) == []
    assert select_layers(s, 1) == [0]
    assert select_layers(s, 6) == list(range(6))  # N == L forces the end at L-1
    s2 = [5.0, 0.0, 0.0, 0.0, 9.0, 1.0]  # N = L-1: end L-2 (larger s) holds gaps of 1
    assert select_layers(s2, 5) == [0, 1, 2, 3, 4]
    assert select_layers([1.0, 2.0], 2) == [0, 1]


def test_explicit_layers_validated():
    s = [0.0] * 16
    assert select_layers(s, 3, mla_layers=[10, 0, 5]) == [0, 5, 10]
    assert select_layers(None, 2, mla_layers=[3, 1], num_layers=4) == [1, 3]
    with pytest.raises(ConfigError, match="mla_layers: index 16 out of range for a 16-layer model"):
        select_layers(s, 2, mla_layers=[0, 16])
    with pytest.raises(ConfigError, match="mla_layers: layer 5 is listed more than once"):
        select_layers(s, 3, mla_layers=[0, 5, 5])
    with pytest.raises(ConfigError, match=r"mla_layers: expected 4 layers \(n_mla\), got 3"):
        select_layers(s, 4, mla_layers=[0, 5, 10])
    with pytest.raises(ConfigError, match="mla_layers: expected integer"):
        select_layers(s, 1, mla_layers=[1.0])


def test_errors():
    with pytest.raises(ConfigError, match="n_mla"):
        select_layers([0.0] * 4, 5)
    with pytest.raises(ConfigError, match="n_mla"):
        select_layers([0.0] * 4, -1)
    with pytest.raises(ConfigError, match="n_mla"):
        select_layers([0.0] * 4, True)
    with pytest.raises(ConfigError, match=r"sensitivity\[2\]"):
        select_layers([0.0, 1.0, float("nan"), 0.0], 2)
    with pytest.raises(ConfigError, match="sensitivity: required"):
        select_layers(None, 2)
    with pytest.raises(ConfigError, match="kl_per_layer: expected one value for every layer"):
        sensitivities(1.0, {0: 0.5, 2: 0.3})
    with pytest.raises(ConfigError, match="kl_all"):
        sensitivities(float("inf"), [0.1])
    assert sensitivities(1.0, {1: 0.25, 0: 0.5}) == [0.5, 0.75]


def test_report_files(tmp_path):
    import matplotlib.image as mpimg

    rng = random.Random(3)
    kl_all = 0.8123
    kl = [kl_all - rng.uniform(-0.05, 0.3) for _ in range(16)]
    s = sensitivities(kl_all, kl)
    chosen = select_layers(s, 4)
    kv = kv_report(load_teacher_config("llama-3.2-1b"), chosen, 128, 32)
    paths = write_smart_report(tmp_path / "rep", kl_all, kl, chosen, kv_report=kv)
    for kind in ("json", "md", "png"):
        assert paths[kind].is_file() and paths[kind].name == f"smart_report.{kind}"

    data = json.loads(paths["json"].read_text())
    assert data["chosen"] == chosen and data["n_mla"] == 4 and data["num_layers"] == 16
    assert [r["kl"] for r in data["layers"]] == kl
    assert data["kv"]["compression"] == pytest.approx(25.6)

    md = paths["md"].read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == 16
    for i, row in enumerate(rows):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert int(cells[0]) == i
        assert float(cells[1]) == pytest.approx(kl[i], rel=1e-5)
        assert float(cells[2]) == pytest.approx(s[i], rel=1e-5, abs=1e-9)
        assert (cells[3] == "yes") == (i in chosen)
    assert "| layer | KL with layer as MLA | sensitivity | chosen |" in md and "25.6x" in md

    img = mpimg.imread(paths["png"])
    assert img.shape[:2] == (round(FIG_SIZE_IN[1] * FIG_DPI), round(FIG_SIZE_IN[0] * FIG_DPI))
    assert img.std() > 0.01  # not blank


def test_report_without_kv_and_bad_chosen(tmp_path):
    paths = write_smart_report(tmp_path, 1.0, [0.9, 0.5, 0.7], [0, 1])
    assert json.loads(paths["json"].read_text())["kv"] is None
    with pytest.raises(ConfigError, match="layers: index 3 out of range"):
        write_smart_report(tmp_path, 1.0, [0.9, 0.5, 0.7], [0, 3])
