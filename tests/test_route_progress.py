"""The route's progress line: stage number, elapsed time and an ETA from measured seconds per step."""
from distill.dpo_stage import dpo_configs
from distill.kd import kd_configs
from distill.stage import ild_configs
from upcycle.route_progress import RouteProgress, minutes, training_plan


def make_progress(tmp_path, clock):
    plan = {"init": None,
            "ild_mla": {"kind": "ild", "max_steps": 40, "tokens_per_step": 2048, "output_dir": str(tmp_path / "a")},
            "ild_mamba2": {"kind": "ild", "max_steps": 40, "tokens_per_step": 2048, "output_dir": str(tmp_path / "b")},
            "smart": None, "compose": None,
            "kd": {"kind": "kd", "max_steps": 20, "tokens_per_step": 2048, "output_dir": str(tmp_path / "c")},
            "dpo": {"kind": "dpo", "max_steps": 10, "tokens_per_step": 4096, "output_dir": str(tmp_path / "d")},
            "report": None}
    return RouteProgress(plan, clock=clock)


def test_eta_from_measured_stages(tmp_path):
    now = [0.0]
    p = make_progress(tmp_path, lambda: now[0])
    assert p.line("init") == ("route: stage 1/8 init (elapsed 0s, 40+40+20+10 training steps left; "
                              "ETA once a training stage has been measured)")
    now[0] = 30.0
    assert p.line("ild_mla").startswith("route: stage 2/8 ild_mla (elapsed 30s, 40+40+20+10 training steps left;")
    now[0] = 60.0 + 2400
    p.finished("ild_mla", {"steps": 40, "seconds": 2400.0})  # 60 s/step
    # the second ILD at the first's 60 s/step; KD (same tokens per step) at 60, DPO (twice the tokens) at 120
    assert p.line("ild_mamba2") == ("route: stage 3/8 ild_mamba2 (elapsed 41m, ETA ~1h20m for 40+20+10 training "
                                    "steps left, from measured s/step)")
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step_30\n")  # a resumed stage: 10 steps left
    assert "ETA ~50m for 10+20+10 training steps left" in p.line("ild_mamba2")
    p.finished("ild_mamba2", {"steps": 40, "seconds": 1200.0})  # 30 s/step: the latest measurement wins
    assert "stage 4/8 smart" in p.line("smart") and "ETA ~20m for 20+10 training steps left" in p.line("smart")
    p.finished("kd", {"steps": 20, "seconds": 200.0})  # 10 s/step, 4.9 ms/token: DPO 20 s/step
    assert "ETA ~3m for 10 training steps left" in p.line("dpo")
    p.finished("dpo", {"steps": 10, "seconds": 100.0})
    now[0] = 2 * 3600 + 5 * 60
    assert p.line("report") == "route: stage 8/8 report (elapsed 2h05m, no training left)"


def test_minutes_and_training_plan():
    assert [minutes(s) for s in (5, 59.4, 61, 3599, 3660)] == ["5s", "59s", "1m", "1h00m", "1h01m"]
    ild = training_plan("ild", ild_configs({"student": {"path": "s"}, "data": {"path": "x", "seq_len": 256}, "optim": {
        "micro_batch_size": 4, "global_batch_size": 8, "max_steps": 40, "lr": 1e-4}, "run": {"output_dir": "o"}}))
    assert ild == {"kind": "ild", "max_steps": 40, "tokens_per_step": 2048, "output_dir": "o"}
    dpo = training_plan("dpo", dpo_configs({"student": {"path": "s"}, "data": {
        "path": "x", "max_length": 512, "max_prompt_length": 256}, "optim": {
        "micro_batch_size": 2, "global_batch_size": 4, "max_steps": 10, "lr": 1e-6}, "run": {"output_dir": "o"}}))
    assert dpo["tokens_per_step"] == 4 * 2 * 512
    kd = training_plan("kd", kd_configs({"student": {"path": "s"}, "data": {"path": "x.json", "max_length": 256},
                                         "optim": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 5, "lr": 1e-5},
                                         "run": {"output_dir": "o"}}))
    assert kd["tokens_per_step"] == 4 * 256


def test_eta_leaves_out_the_first_steps_autotuning(tmp_path):
    """A cold machine's first step autotunes for minutes (150 s for the Mamba2 student on an H200): the stage's
    steady seconds per step, when it reports one, is what the estimate scales, not its mean."""
    p = make_progress(tmp_path, lambda: 0.0)
    p.finished("ild_mla", {"steps": 40, "seconds": 150.0 + 39 * 0.5, "seconds_per_step": 0.5})
    assert "ETA ~40s for 40+20+10 training steps left" in p.line("ild_mamba2")  # 40 x 0.5 + 20 x 0.5 + 10 x 1.0
    p.finished("ild_mamba2", {"steps": 1, "seconds": 150.0, "seconds_per_step": None})  # one step: nothing steady
    assert "ETA ~1h40m" in p.line("kd")  # only then the mean stands: 20 x 150 + 10 x 300 s


def test_steps_left_come_from_the_checkpoint_the_store_names_latest(tmp_path):
    """The step of ``checkpoints/latest`` (a step saved again: ``step_N.k``); a damaged ``latest`` counts as none."""
    p = make_progress(tmp_path, lambda: 0.0)
    ckpt = tmp_path / "a" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("step_12.1\n")
    assert "28+40+20+10 training steps left" in p.line("init")
    (ckpt / "latest").unlink()
    (ckpt / "latest").mkdir()  # not a file: the stage says so itself when it resumes
    assert "40+40+20+10 training steps left" in p.line("init")
