"""The loss-parity benchmark on a CPU: our model against a CPU peer (our model again, other seeds and the old
init) on the real packed data, both fed the same batches with the same learning rate at every step."""
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import assert_chart

TINY = ["hidden_size=64", "intermediate_size=128", "hybrid_override_pattern=M-M-", "gdn.num_heads=2",
        "gdn.head_dim=16", "gdn.num_v_heads=4", "gdn.head_v_dim=16"]


def test_cpu_run_same_batches_same_lrs(tmp_path, austen_data):
    from benchmarks.harness import loss_parity as LP
    from hybridlm.data import DataConfig, PackedBatches, PackedTokens
    from hybridlm.engine.schedule import lr_at

    steps, out = 4, tmp_path / "parity"
    report = LP.main(["--family", "gdn", "--steps", str(steps), "--out", str(out), "--data", str(austen_data),
                      "--peer", "ours", "--peer-init", "legacy", "--seeds", "1", "--ours-seeds", "0",
                      "--micro-batch", "2", "--seq", "32", "--warmup", "2", "--lr", "1e-3", "--min-lr", "1e-4",
                      "--val-interval", "2", "--val-batches", "1", "--model-override", *TINY])
    saved = json.loads((out / "loss_parity.json").read_text())
    assert_chart(out / "loss_parity.png")
    assert saved["family"] == "gdn" and saved["steps"] == steps and saved["precision"] == "fp32"
    runs = saved["runs"]
    assert [(r["role"], r["seed"], r["init"]) for r in runs] == [("ours", 0, "fla"), ("peer", 1, "legacy")]
    # the batches are the training loader's, in its order, for every run
    loader = PackedBatches(PackedTokens(austen_data, "train"), 32, 2, 0, 1, DataConfig.seed)
    expected = [next(loader)["input_ids"] for _ in range(steps)]
    hashes = [LP.batch_hash(ids) for ids in expected]
    lrs = [lr_at(s, lr=1e-3, min_lr=1e-4, warmup_steps=2, max_steps=steps) for s in range(steps)]
    for r in runs:
        assert r["batch_hash"] == hashes and r["first_tokens"] == [ids[0, :4].tolist() for ids in expected]
        assert r["lr"] == pytest.approx(lrs, rel=1e-12)
        assert len(r["train_loss"]) == len(r["grad_norm"]) == steps
        assert all(math.isfinite(x) for x in r["train_loss"] + r["grad_norm"])
        assert [v["step"] for v in r["val"]] == [2, 4] and r["params"] == saved["ours_params"]
    assert len(set(hashes)) == steps  # distinct batches, not one repeated
    assert saved["checks"] == {"compared_steps": steps, "same_batches": True, "same_first_tokens": True,
                               "same_lrs": True, "same_param_counts": True, "same_param_groups": True}
    # two decay groups, the same for every run: 1-D parameters (norms, A_log, dt_bias) not decayed
    groups = runs[0]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and sum(g["numel"] for g in groups) == saved["ours_params"]
    assert saved["ours_val_loss"] == runs[0]["final_val_loss"] == runs[0]["val"][-1]["loss"]
    assert saved["peer_val_loss"] == runs[1]["final_val_loss"] and saved["peer_spread"] is None  # one peer seed
    assert saved["gap"] == pytest.approx(saved["ours_val_loss"] - saved["peer_val_loss"])
    assert saved["ours_train_losses"] == runs[0]["train_loss"] and saved["peer_lrs"] == runs[1]["lr"]
    assert saved["ours_step1_grad_norm"] == runs[0]["grad_norm"][0]
    assert report["checks"]["same_batches"]
    (out / "loss_parity.png").unlink()  # --replot redraws the chart of a (cut-off) run from its JSON
    LP.main(["--replot", "--out", str(out)])
    assert_chart(out / "loss_parity.png")
    # the old init's conv weights (std ~0.29 instead of 0.02) give a larger first gradient
    assert runs[1]["grad_norm"][0] > runs[0]["grad_norm"][0]


def _run(role, hashes, lrs, val=None, seed=0, init="fla"):
    return {"role": role, "seed": seed, "init": init, "legacy_parts": [], "params": 10, "batch_hash": hashes,
            "first_tokens": [[1]] * len(hashes), "lr": lrs, "train_loss": [1.0] * len(hashes),
            "grad_norm": [2.0] * len(hashes), "val": [], "final_val_loss": val,
            "param_groups": [{"weight_decay": 0.1, "numel": 10}]}


def test_summary_peer_spread_and_ablation_rows():
    from benchmarks.harness.loss_parity import summarize
    h, lr = ["a", "b"], [1.0, 2.0]
    report = {"runs": [_run("ours", h, lr, 4.60), _run("ours", h, lr, 4.70, init="legacy"),
                       _run("peer", h, lr, 4.50, seed=0), _run("peer", h, lr, 4.54, seed=1)]}
    summarize(report)
    assert report["ours_val_loss"] == 4.60 and report["peer_val_loss"] == pytest.approx(4.52)
    assert report["peer_spread"] == pytest.approx(0.04) and report["peer_seeds"] == [0, 1]
    assert report["gap"] == pytest.approx(0.08) and report["gap_over_peer_spread"] == pytest.approx(2.0)
    assert [(r["init"], r["val_loss"]) for r in report["ablation"]] == [("fla", 4.60), ("legacy", 4.70)]
    assert report["ablation"][1]["gap_to_peer"] == pytest.approx(0.18)


def test_checks_catch_different_batches_or_lrs():
    from benchmarks.harness.loss_parity import summarize
    run = _run

    report = {"runs": [run("ours", ["a", "b"], [1.0, 2.0]), run("peer", ["a", "c"], [1.0, 2.0])]}
    summarize(report)
    assert not report["checks"]["same_batches"] and report["checks"]["same_lrs"]
    report = {"runs": [run("ours", ["a", "b"], [1.0, 2.0]), run("peer", ["a", "b"], [1.0, 3.0])]}
    summarize(report)
    assert report["checks"]["same_batches"] and not report["checks"]["same_lrs"]


@pytest.mark.parametrize("family,peer,overrides", [
    ("gdn", "fla", TINY),
    ("kda", "fla", ["hidden_size=64", "intermediate_size=128", "hybrid_override_pattern=M-M-", "kda.num_heads=2",
                    "kda.head_dim=16", "kda.num_v_heads=2", "kda.head_v_dim=32"]),
    ("mamba2", "fla", ["hidden_size=64", "hybrid_override_pattern=M-M-", "mamba2.d_state=16", "mamba2.head_dim=16",
                       "mamba2.n_groups=2"]),
    ("mamba2", "hf", ["hidden_size=64", "hybrid_override_pattern=M-M-", "mamba2.d_state=16", "mamba2.head_dim=16",
                      "mamba2.n_groups=2"]),
])
def test_peers_have_our_parameter_count(family, peer, overrides, austen_data):
    """The peers built for the GPU runs (fla's need CUDA only to run) have exactly our parameter count; for
    mamba2 the pattern becomes one mixer per sublayer (the peers' blocks have no MLP)."""
    pytest.importorskip("fla.models")
    from benchmarks.harness import loss_parity as LP

    args = LP.parse_args(["--family", family, "--out", "unused", "--peer", peer, "--seq", "32",
                          "--model-override", *overrides])
    config = LP.resolve_config(args, austen_data)
    if family == "mamba2":
        assert config.layer_plan == ["mamba2"] * 4
    ours, _ = LP.build_ours(config, 0)
    model, info = LP.build_peer(peer, family, config, 0, args)
    assert LP.count_params(model) == LP.count_params(ours) > 0
    assert info["init"].startswith("its own")
    with pytest.raises(SystemExit, match="CUDA"):
        if not torch.cuda.is_available() and peer == "fla":
            LP.main(["--family", family, "--out", "unused", "--model-override", *overrides])
        else:
            raise SystemExit("CUDA")


MAMBA2_TINY = ["hidden_size=64", "hybrid_override_pattern=M-M-", "mamba2.d_state=16", "mamba2.head_dim=16",
               "mamba2.n_groups=2"]


def test_peer_init_follows_the_transformers_mamba2_step_by_step(tmp_path, austen_data):
    """``--ours-init peer``: ours starts from the weights of transformers' Mamba2 built with the same seed; the
    two compute the same function (tests/test_peer_weights.py), so on a CPU in fp32 they train alike."""
    pytest.importorskip("transformers.models.mamba2")
    from benchmarks.harness import loss_parity as LP

    out = tmp_path / "parity"
    LP.main(["--family", "mamba2", "--steps", "3", "--out", str(out), "--data", str(austen_data), "--peer", "hf",
             "--ours-init", "peer", "--seeds", "0", "--micro-batch", "2", "--seq", "32", "--warmup", "1", "--lr", "2e-2",
             "--min-lr", "2e-3",
             "--val-interval", "3", "--val-batches", "1", "--peer-chunk-size", "16", "--peer-ssd", "reference",
             "--model-override", *MAMBA2_TINY])
    saved = json.loads((out / "loss_parity.json").read_text())
    assert saved["peer_ssd"] == "reference" and saved["peer_ssd_check"] is None
    ours, peer = saved["runs"]
    assert (ours["role"], ours["init"], ours["seed"], peer["role"]) == ("ours", "peer", 0, "peer")
    assert ours["weights_from"] == "transformers.Mamba2ForCausalLM" and ours["copied_tensors"] > 0
    assert saved["ours_init"] == ["peer"] and saved["ablation"][0]["init"] == "peer"
    assert peer["train_loss"][-1] < peer["train_loss"][0] - 0.1  # the weights moved (lr 2e-2)
    assert ours["train_loss"] == pytest.approx(peer["train_loss"], rel=1e-5)  # measured: 2e-7
    assert ours["grad_norm"] == pytest.approx(peer["grad_norm"], rel=1e-4)  # measured: 7e-6
    assert ours["final_val_loss"] == pytest.approx(peer["final_val_loss"], rel=1e-5)


def test_peer_init_against_peer_ours_is_the_peers_weights(austen_data):
    """With ``--peer ours`` the ``peer`` variant is the peer run's initial model, tensor for tensor."""
    from benchmarks.harness import loss_parity as LP

    args = LP.parse_args(["--family", "gdn", "--out", "unused", "--peer", "ours", "--peer-init", "legacy",
                          "--ours-init", "fla", "peer", "--seq", "32", "--model-override", *TINY])
    config = LP.resolve_config(args, austen_data)
    copy, info = LP.build_ours(config, 3, "peer", args)
    peer, _ = LP.build_peer("ours", "gdn", config, 3, args)
    fresh, _ = LP.build_ours(config, 3)
    assert info["init"] == "peer" and info["weights_from_seed"] == 3 and info["copied_tensors"] == len(copy.state_dict())
    for (name, a), b in zip(copy.state_dict().items(), peer.state_dict().values()):
        assert torch.equal(a, b), name
    # the legacy peer's convs, not our fla init's
    assert not torch.equal(copy.model.layers[0].mixer.q_conv1d.weight, fresh.model.layers[0].mixer.q_conv1d.weight)
    with pytest.raises(SystemExit):
        LP.parse_args(["--family", "gdn", "--out", "unused", "--peer", "ours", "--peer-init", "peer"])


def test_engine_runs_see_the_same_batches_and_fp32_matches_the_plain_loop(tmp_path, austen_data):
    """--ours-engine trains ours through the engine every stage uses, on the same batches with the same lrs;
    in fp32 it is the plain loop's training (same AdamW, clipping and schedule), so the curves agree."""
    from benchmarks.harness import loss_parity as LP

    steps, out = 4, tmp_path / "engine"
    LP.main(["--family", "gdn", "--steps", str(steps), "--out", str(out), "--data", str(austen_data),
             "--peer", "ours", "--seeds", "0", "--ours-engine", "fp32", "bf16-mixed", "--micro-batch", "2",
             "--seq", "32", "--warmup", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--val-interval", "2",
             "--val-batches", "1", "--model-override", *TINY])
    saved = json.loads((out / "loss_parity.json").read_text())
    runs = {r["init"]: r for r in saved["runs"] if r["role"] == "ours"}
    assert list(runs) == ["fla", "fla+engine:fp32", "fla+engine:bf16-mixed"]
    assert runs["fla+engine:fp32"]["engine_precision"] == "fp32"
    assert saved["checks"]["same_batches"] and saved["checks"]["same_lrs"] and saved["checks"]["same_param_groups"]
    plain, engine, mixed = runs["fla"], runs["fla+engine:fp32"], runs["fla+engine:bf16-mixed"]
    assert engine["train_loss"] == pytest.approx(plain["train_loss"], rel=1e-5, abs=1e-5)
    assert engine["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    assert [v["loss"] for v in engine["val"]] == pytest.approx([v["loss"] for v in plain["val"]], rel=1e-5)
    # bf16 autocast computes something else, close to it
    assert mixed["train_loss"] != engine["train_loss"]
    assert mixed["train_loss"] == pytest.approx(engine["train_loss"], rel=2e-2)
    assert [row["init"] for row in saved["ablation"]] == list(runs)


def test_two_architectures_of_ours_on_the_same_batches(tmp_path, austen_data):
    """--peer-config: the 75 % GDN hybrid against pure GDN (tiny shapes), one recipe, one plot."""
    from benchmarks.harness import loss_parity as LP

    out = tmp_path / "hybrid"
    mla = ("mla={num_heads: 2, q_lora_rank: 16, kv_lora_rank: 8, qk_nope_head_dim: 8, qk_rope_head_dim: 8, "
           "v_head_dim: 16}")
    report = LP.main(["--family", "gdn", "--config", "gdn_300m_hybrid", "--peer", "ours", "--peer-config",
                      "gdn_300m", "--steps", "3", "--out", str(out), "--data", str(austen_data), "--micro-batch",
                      "2", "--seq", "32", "--warmup", "1", "--val-interval", "3", "--val-batches", "1",
                      "--model-override", *TINY[:2], "hybrid_override_pattern=*-M-", *TINY[3:], mla,
                      "--peer-model-override", *TINY])
    saved = json.loads((out / "loss_parity.json").read_text())
    assert saved["pattern"] == "*-M-" and saved["peer_pattern"] == "M-M-" and saved["peer_config_name"] == "gdn_300m"
    assert saved["ours_params"] != saved["peer_params"]  # another architecture: the counts are recorded, not required
    assert [r["name"] for r in saved["runs"]] == ["ours gdn_300m_hybrid", "ours gdn_300m"]
    assert saved["checks"]["same_batches"] and saved["checks"]["same_lrs"] and report["gap"] is not None
    assert_chart(out / "loss_parity.png")


def test_resume_keeps_finished_runs_and_refuses_other_settings(tmp_path, austen_data):
    """--resume: a command cut off by a time limit continues with the runs it had not finished."""
    from benchmarks.harness import loss_parity as LP

    out = tmp_path / "parity"
    argv = ["--family", "gdn", "--steps", "2", "--out", str(out), "--data", str(austen_data), "--peer", "ours",
            "--seeds", "1", "2", "--ours-seeds", "0", "--micro-batch", "2", "--seq", "32", "--warmup", "1",
            "--val-interval", "2", "--val-batches", "1", "--model-override", *TINY]
    full = LP.main(argv)
    saved = json.loads((out / "loss_parity.json").read_text())
    # as if cut off during the last run: two finished runs, one marked so that a re-run would show
    saved["runs"] = saved["runs"][:2]
    saved["runs"][1]["wall_s"] = -1.0
    (out / "loss_parity.json").write_text(json.dumps(saved))
    resumed = LP.main([*argv, "--resume"])
    assert [(r["name"], r["seed"]) for r in resumed["runs"]] == [(r["name"], r["seed"]) for r in full["runs"]]
    assert resumed["runs"][1]["wall_s"] == -1.0  # kept, not trained again
    assert resumed["runs"][2]["wall_s"] > 0 and resumed["runs"][2]["train_loss"] == full["runs"][2]["train_loss"]
    assert resumed["peer_spread"] == pytest.approx(full["peer_spread"])
    with pytest.raises(SystemExit, match=r"error: --resume: .* other settings \(steps"):
        LP.main([*[("3" if a == "2" and argv[i - 1] == "--steps" else a) for i, a in enumerate(argv)], "--resume"])


def test_a_time_limits_sigterm_keeps_the_cut_runs_curve_and_resume_finishes(tmp_path, austen_data, monkeypatch):
    """``timeout`` sends SIGTERM: the run in progress ends after its step with ``cut_at`` and its curve in the
    JSON and chart, no further run starts, the command says how to go on; ``--resume`` then reruns the cut run."""
    import signal

    from benchmarks.harness import loss_parity as LP

    out = tmp_path / "parity"
    argv = ["--family", "gdn", "--steps", "3", "--out", str(out), "--data", str(austen_data), "--peer", "ours",
            "--seeds", "1", "--ours-seeds", "0", "--micro-batch", "2", "--seq", "32", "--warmup", "1",
            "--val-interval", "1", "--val-batches", "1", "--model-override", *TINY]
    real_batches = LP.train_batches
    calls = []

    def batches_then_signal(*a):  # the second run (the peer) is signalled while it takes its second batch
        calls.append(1)
        for i, b in enumerate(real_batches(*a)):
            if len(calls) == 2 and i == 1:
                signal.raise_signal(signal.SIGTERM)
            yield b

    monkeypatch.setattr(LP, "train_batches", batches_then_signal)
    with pytest.raises(SystemExit, match="stopped: SIGTERM.*--resume"):
        LP.main(argv)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the loop
    saved = json.loads((out / "loss_parity.json").read_text())
    ours, peer = saved["runs"]
    assert "cut_at" not in ours and len(ours["train_loss"]) == 3 and ours["final_val_loss"] is not None
    assert peer["cut_at"] == 2 and len(peer["train_loss"]) == 2 and peer["final_val_loss"] is None
    assert saved["peer_val_loss"] is None and len(peer["val"]) == 2
    assert_chart(out / "loss_parity.png")
    monkeypatch.setattr(LP, "train_batches", real_batches)
    resumed = LP.main([*argv, "--resume"])
    assert [len(r["train_loss"]) for r in resumed["runs"]] == [3, 3] and "cut_at" not in resumed["runs"][1]
    assert resumed["runs"][0]["wall_s"] == ours["wall_s"]  # kept
    assert resumed["runs"][1]["train_loss"][:2] == pytest.approx(peer["train_loss"])


def test_peer_parts_copy_only_the_named_tensors(austen_data):
    """``peer:out_proj+A_log``: those tensors are the peer's initial weights, every other tensor is our own init
    with the same seed (the peer's init ablated part by part); a name that matches nothing is an error."""
    pytest.importorskip("transformers.models.mamba2")
    from benchmarks.harness import loss_parity as LP

    args = LP.parse_args(["--family", "mamba2", "--out", "unused", "--peer", "hf", "--seq", "32",
                          "--ours-init", "fla", "peer:out_proj+A_log", "--model-override", *MAMBA2_TINY])
    config = LP.resolve_config(args, austen_data)
    part, info = LP.build_ours(config, 0, "peer:out_proj+A_log", args)
    whole, _ = LP.build_ours(config, 0, "peer", args)
    own, _ = LP.build_ours(config, 0, "fla")
    names = [n for n, _ in part.named_parameters()]
    copied = [n for n in names if n.split(".")[-2] == "out_proj" or n.endswith("A_log")]
    assert info["copied_tensors"] == len(copied) == 8  # 4 mixers x (out_proj, A_log)
    sd_part, sd_whole, sd_own = part.state_dict(), whole.state_dict(), own.state_dict()
    for n in names:
        expected = sd_whole[n] if n in copied else sd_own[n]
        assert torch.equal(sd_part[n], expected), n
    assert not torch.equal(sd_whole[copied[0]], sd_own[copied[0]])  # the two inits do differ there
    with pytest.raises(ValueError, match="no tensor of ours is named 'outproj'"):
        LP.build_ours(config, 0, "peer:outproj", args)
    with pytest.raises(SystemExit):
        LP.parse_args(["--family", "mamba2", "--out", "u", "--peer", "hf", "--ours-init", "peer:"])


def test_only_ours_and_only_peer_merge_into_the_full_report(tmp_path, austen_data):
    """``--only ours`` and ``--only peer`` (two processes sharing a GPU) joined by ``--merge`` give the report of
    one process that ran both: the same runs, curves, gap and checks; other settings or a run twice are refused."""
    from benchmarks.harness import loss_parity as LP

    argv = ["--family", "gdn", "--steps", "2", "--data", str(austen_data), "--peer", "ours", "--seeds", "1",
            "--ours-seeds", "0", "--micro-batch", "2", "--seq", "32", "--warmup", "1", "--val-interval", "2",
            "--val-batches", "1", "--model-override", *TINY]
    full = LP.main([*argv, "--out", str(tmp_path / "full")])
    ours = LP.main([*argv, "--out", str(tmp_path / "ours"), "--only", "ours"])
    peer = LP.main([*argv, "--out", str(tmp_path / "peer"), "--only", "peer"])
    assert [r["role"] for r in ours["runs"]] == ["ours"] and [r["role"] for r in peer["runs"]] == ["peer"]
    parts = [str(tmp_path / side / "loss_parity.json") for side in ("ours", "peer")]
    merged = LP.main(["--merge", *parts, "--out", str(tmp_path / "merged")])
    assert [(r["name"], r["seed"]) for r in merged["runs"]] == [(r["name"], r["seed"]) for r in full["runs"]]
    for a, b in zip(merged["runs"], full["runs"]):
        assert a["train_loss"] == b["train_loss"] and a["val"] == b["val"]
    for key in ("ours_val_loss", "peer_val_loss", "gap"):
        assert merged[key] == pytest.approx(full[key]), key
    assert merged["checks"] == full["checks"] and all(v for k, v in merged["checks"].items() if k != "compared_steps")
    assert_chart(tmp_path / "merged" / "loss_parity.png")
    with pytest.raises(SystemExit, match="more than one report"):
        LP.main(["--merge", parts[0], str(tmp_path / "full" / "loss_parity.json"), "--out", str(tmp_path / "bad")])
    other = json.loads(Path(parts[1]).read_text())
    other["steps"] = 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"other settings .*\(steps"):
        LP.main(["--merge", parts[0], str(tmp_path / "other.json"), "--out", str(tmp_path / "bad")])
