"""Done means the verified export: ``final/.complete`` lists every file with its size, and a stage or run is
finished only when they all match. A ``final/`` that does not verify is redone from the last checkpoint, or refused
in one line when none is left; and a route's every section, each stage's optim options included, is checked before
its first stage, errors naming the whole key."""
import re

import pytest

from distill.stage import check_unfinished_export, finished_stage
from hybridlm.config.errors import ConfigError
from hybridlm.training import RunConfig
from hybridlm.training.shell import export_model
from hybridlm.utils.atomic import COMPLETE_MARKER, verify_complete_directory, write_json
from test_route_inputs import route_config
from upcycle.route import run_route


def export(final):
    def write(tmp):
        (tmp / "config.json").write_text("{}\n")
        (tmp / "weights").mkdir()
        (tmp / "weights" / "model.safetensors").write_bytes(b"\0" * 1000)
        write_json(tmp / "stage.json", {"stage": "kd", "steps": 2})
    return export_model(final, write, amendable=("stage.json",))


def test_the_marker_lists_every_file_and_verifies_them(tmp_path):
    final = export(tmp_path / "final")
    assert (final / COMPLETE_MARKER).read_text().splitlines() == ["complete", "3 config.json", "- stage.json",
                                                                  "1000 weights/model.safetensors"]
    assert verify_complete_directory(final) is None
    write_json(final / "stage.json", {"stage": "kd", "steps": 2, "val": {"reward_margin": 0.5}})  # amended later
    assert verify_complete_directory(final) is None


@pytest.mark.parametrize("damage, why", [
    (lambda f: (f / COMPLETE_MARKER).unlink(), r"\.complete is missing"),
    (lambda f: (f / "weights" / "model.safetensors").write_bytes(b"\0" * 10), r"model\.safetensors holds 10 bytes, "
                                                                              r".* lists 1000"),
    (lambda f: (f / "config.json").unlink(), r"config\.json, listed in .*, is missing"),
    (lambda f: (f / "stage.json").unlink(), r"stage\.json, listed in .*, is missing"),
    (lambda f: (f / COMPLETE_MARKER).write_text("half"), r"is not a completion marker"),
])
def test_a_damaged_export_does_not_verify(tmp_path, damage, why):
    final = export(tmp_path / "final")
    damage(final)
    reason = verify_complete_directory(final)
    assert reason is not None
    assert re.search(why, reason), reason


def test_a_marker_from_before_listings_still_verifies(tmp_path):
    final = export(tmp_path / "final")
    (final / COMPLETE_MARKER).write_text("complete\n")
    assert verify_complete_directory(final) is None


def stage_run(tmp_path):
    return RunConfig(output_dir=str(tmp_path / "kd"))


def test_a_final_holding_only_its_record_is_not_finished_and_is_refused_without_a_checkpoint(tmp_path):
    run = stage_run(tmp_path)
    write_json(tmp_path / "kd" / "final" / "stage.json", {"stage": "kd", "steps": 2})
    assert finished_stage(run) is None
    with pytest.raises(ConfigError) as e:
        check_unfinished_export(run)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"run.output_dir: {tmp_path / 'kd' / 'final'} is not a verified export "
                                              f"({tmp_path / 'kd' / 'final' / '.complete'} is missing")
    assert "no checkpoint is left" in msg and "move" in msg


def test_an_unverified_final_with_a_checkpoint_is_redone_from_it(tmp_path):
    run = stage_run(tmp_path)
    export(tmp_path / "kd" / "final")
    assert finished_stage(run) == {"stage": "kd", "steps": 2}
    (tmp_path / "kd" / "final" / COMPLETE_MARKER).unlink()
    assert finished_stage(run) is None
    (run.checkpoint_dir).mkdir()
    (run.checkpoint_dir / "latest").write_text("step_2\n")
    check_unfinished_export(run)  # no refusal: the stage resumes from step_2 and exports again


def test_no_final_is_simply_a_stage_to_run(tmp_path):
    run = stage_run(tmp_path)
    assert finished_stage(run) is None
    check_unfinished_export(run)


@pytest.mark.parametrize("key, value, message", [
    ("kd.optim.group_lr", {"foo": 1.0e-4}, r"^kd\.optim\.group_lr\.foo: not a parameter group of a student; "
                                           r"expected one of inherited, mixer, latent$"),
    ("dpo.optim.group_lr", {"inherited": 0, "mixer": 0, "latent": 0}, r"^dpo\.optim\.group_lr: every parameter "
                                                                      r"group is frozen"),
    ("ild.optim.group_lr", {"mixer": -1}, r"^ild\.optim\.group_lr\.mixer: expected a learning rate >= 0"),
])
def test_each_stage_optim_is_checked_before_the_first_stage_naming_the_whole_key(tmp_path, key, value, message):
    cfg = route_config(tmp_path, tmp_path / "no_teacher_needed_yet", {key: value})
    with pytest.raises(ConfigError, match=message):
        run_route(cfg)
    assert not (tmp_path / "route").exists()  # nothing ran, nothing was written
