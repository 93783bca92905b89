"""A training stage added in this file alone (docs/design.md, "A stage"): one StageSpec, registered once, is
planned by `upcycle plan`, checked and placed by the route, counted by its progress line, given a subcommand, and
(slow) run by `upcycle run` after DPO, on DPO's output."""
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import REPO, subprocess_env, tiny_route_overrides
from distill.stage import packed_lm_batches, run_stage, stage_configs
from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, setting
from upcycle.footprint import StagePlan, trained_bytes
from upcycle.stages import STAGES, StageSpec, register_stage

TOY_SECTIONS = ("teacher", "student", "data", "optim", "run", "runtime", "toy")


@dataclass
class ToyConfig(Section):
    """The ``toy:`` section: a factor on the student's own next-token loss."""
    scale: float = setting(1.0, gt=0)


def toy_configs(sections, where=""):
    return stage_configs(sections, extra={"toy": ToyConfig}, where=where)


def run_toy(configs):
    """The student's next-token loss on packed text, times ``toy.scale``; only the final norm trains."""
    scale = configs["toy"].scale

    def make_loss(_teacher):
        return lambda student, batch: (student(input_ids=batch["input_ids"], shift_labels=batch["labels"]).loss
                                       * scale, {})

    return run_stage("toy", configs, make_loss, lambda student: student.model.norm.parameters(),
                     make_batches=packed_lm_batches)


def plan_toy(name, p, configs, gpus):
    s, optim = configs["data"].seq_len, configs["optim"]
    b, tokens = optim.micro_batch_size, optim.max_steps * optim.global_batch_size * s
    hp, norm = p.hybrid.params["total"], p.shapes["d"]
    by = {"teacher weights (bf16)": 2 * p.teacher_params, **trained_bytes(hp, norm, gpus),
          "activations": p.hybrid.activations(b * s, optim.activation_checkpointing)}
    return [StagePlan(name, gpus, b, s, tokens, by, (2.0 * hp + 4.0 * norm) * tokens, "the final norm trains")]


TOY = StageSpec("toy", toy_configs, run_toy, plan_toy, "the final norm trains", command="toy",
                sections=TOY_SECTIONS, help="a toy stage: the final norm on the student's own loss")


@pytest.fixture
def toy():
    register_stage(TOY)
    yield TOY
    STAGES.pop(TOY.name)


def tiny_route(tmp_path):
    optim = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 3, "lr": 1e-4}
    return {"output_dir": str(tmp_path / "route"),
            "init": {"q_lora_rank": 48, "kv_lora_rank": 24, "qk_rope_head_dim": 8},
            "ild": {"data": {"path": "ild_data", "seq_len": 32}, "optim": dict(optim)},
            "smart": {"n_mla": 2},
            "kd": {"data": {"format": "packed", "path": "ild_data", "seq_len": 32}, "optim": dict(optim)},
            "dpo": {"data": {"path": "pairs.json", "max_length": 32, "max_prompt_length": 16}, "optim": dict(optim)},
            "toy": {"data": {"path": "ild_data", "seq_len": 64}, "optim": dict(optim), "toy": {"scale": 0.5}}}


def test_a_toy_stage_is_planned_checked_placed_counted_and_given_a_subcommand(toy, tmp_path, capsys):
    from transformers import LlamaConfig

    from upcycle.cli import build_parser
    from upcycle.route import route_sections
    from upcycle.route_progress import training_plan
    from upcycle.stages import check_route, route_stage_sections

    route = tiny_route(tmp_path)
    (tmp_path / "route.yaml").write_text(yaml.safe_dump(route))
    LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=300).to_json_file(tmp_path / "teacher.json")
    # planned: `upcycle plan` prints its row after DPO's, from its hook
    args = build_parser().parse_args(["plan", "--config", str(tmp_path / "route.yaml"), "--gpus", "2",
                                      "--teacher", str(tmp_path / "teacher.json")])
    result = args.fn(args)
    rows = {r["stage"]: r for r in result["stages"]}
    assert list(rows) == ["init", "ild_mla", "ild_mamba2", "smart", "kd", "dpo", "toy"]
    assert rows["toy"]["tokens"] == 3 * 4 * 64 and rows["toy"]["seq_len"] == 64
    assert rows["toy"]["note"] == "the final norm trains"
    assert any(line.startswith("| toy ") for line in capsys.readouterr().out.splitlines())
    # the route: a section of its name, checked by its schema with the others, training DPO's output
    assert route_sections()[-3:] == ("dpo", "toy", "report")
    built = check_route(route_stage_sections(route, tmp_path / "route", "teacher"))
    assert list(built) == ["ild", "kd", "dpo", "toy"] and built["toy"]["toy"].scale == 0.5
    assert built["toy"]["student"].path == str(tmp_path / "route" / "dpo" / "final")
    assert built["toy"]["run"].output_dir == str(tmp_path / "route" / "toy")
    with pytest.raises(ConfigError, match=r"^toy\.toy: unknown key 'scael'"):
        check_route(route_stage_sections({**route, "toy": {**route["toy"], "toy": {"scael": 2}}}, tmp_path, "t"))
    without = {k: v for k, v in route.items() if k != "toy"}  # optional: no section, no stage
    assert list(check_route(route_stage_sections(without, tmp_path, "t"))) == ["ild", "kd", "dpo"]
    # counted: the progress line's tokens per step are the stage's own
    assert training_plan("toy", built["toy"])["tokens_per_step"] == 4 * 64
    # a subcommand of its own, on a single-stage config
    args = build_parser().parse_args(["toy", "--config", "toy.yaml", "optim.lr=1e-3"])
    assert args.overrides == ["optim.lr=1e-3"] and args.fn.args == (TOY,)


DRIVER = """
import sys
sys.path.insert(0, "tests")
from test_toy_stage import TOY
from upcycle.stages import register_stage
register_stage(TOY)
from upcycle.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


# a whole CPU route (~150 s on 2 cores, as tests/test_route.py's) with the toy stage after DPO
@pytest.mark.slow
def test_the_route_runs_and_reports_a_toy_stage(tmp_path):
    out = tmp_path / "route"
    overrides = tiny_route_overrides(tmp_path, stages=("ild", "kd", "dpo", "toy"))
    overrides += [f"toy.data.path={tmp_path / 'data'}", "toy.data.seq_len=32", "toy.optim.precision=fp32",
                  "toy.optim.lr=1e-3", "toy.toy.scale=0.5", "report.generation_prompts=0"]
    cmd = [sys.executable, "-c", DRIVER, "run", "--config", "configs/upcycle/smollm2_route_cpu.yaml", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("route: stage ")]
    assert [line.split()[3] for line in lines] == ["init", "ild_mla", "ild_mamba2", "smart", "compose", "kd", "dpo",
                                                   "toy", "report"]
    assert lines[7].startswith("route: stage 8/9 toy (elapsed ") and "ETA ~" in lines[7] and "for 1 training" in \
        lines[7]
    route = json.loads((out / "route.json").read_text())
    record = json.loads((out / "toy" / "final" / "stage.json").read_text())
    assert route["toy"]["steps"] == record["steps"] == 1 and record["stage"] == "toy"
    assert record["student"] == str(out / "dpo" / "final") and Path(out / "toy" / "final" / "config.json").is_file()
