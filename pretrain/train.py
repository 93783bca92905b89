"""From-scratch pre-training of a pattern-defined hybrid on the shared ZeRO-1 engine.

Composes: the data layer (prepare if needed, packed resumable batches), the model definition, the
engine (loss = chunked fused cross-entropy), the shared training loop, then export + a sample.
:func:`prepare_pretraining` and :func:`build_engine` are the first two steps on their own, so that
``benchmarks.train_speed`` times exactly this job's training steps.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from hybridlm.config.structured import build_dataclass, to_dict
from hybridlm.data import DataConfig, PackedBatches, ensure_prepared, load_tokenizer, open_splits, read_meta
from hybridlm.engine import DistInfo, Engine, OptimConfig, barrier, init_distributed, seed_everything
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.configuration import resolve_model_config
from hybridlm.model.generate import save_tokenizer, set_generation_defaults
from hybridlm.model.runtime import RuntimeSettings
from hybridlm.model.summary import model_summary
from hybridlm.training import RunConfig, train_loop
from hybridlm.config.errors import ConfigError
from hybridlm.training.shell import RunShell, export_model
from hybridlm.utils.faults import kill_in, with_nan_faults
from hybridlm.utils.atomic import is_complete_directory, json_text, write_json
from hybridlm.utils.ranks import is_rank_zero


# a pre-training config's sections; ``runtime`` (optional): how the model runs (hybridlm/model/runtime.py)
PRETRAIN_SECTIONS = ("model", "data", "optim", "run", "runtime")


def runtime_section(sections: Dict[str, Any]) -> RuntimeSettings:
    """The ``runtime`` section built and checked (the defaults when absent)."""
    return build_dataclass(RuntimeSettings, sections.get("runtime") or {}, "runtime")


@dataclass
class PretrainConfig:
    """A pre-training config, each section built into its dataclass once and handed down; ``model`` stays the
    user's mapping (it is resolved against the prepared data's tokenizer, :func:`resolve_model_config`)."""
    model: Dict[str, Any]
    data: DataConfig
    optim: OptimConfig
    run: RunConfig
    runtime: RuntimeSettings


def pretrain_config(sections: Dict[str, Any]) -> PretrainConfig:
    """The sections of :data:`PRETRAIN_SECTIONS` built (keys and values checked, one ``error:`` line naming the
    field)."""
    data = build_dataclass(DataConfig, sections["data"], "data")
    optim = build_dataclass(OptimConfig, sections["optim"], "optim")
    run = build_dataclass(RunConfig, sections["run"], "run")
    return PretrainConfig(dict(sections["model"]), data, optim, run, runtime_section(sections))


def lm_loss(model, batch):
    """Next-token cross-entropy (labels are already shifted by the packer)."""
    out = model(input_ids=batch["input_ids"], shift_labels=batch["labels"])
    return out.loss, {}


@dataclass
class PretrainingSetup:
    """Everything :func:`run_pretraining` trains with, before the model exists (see :func:`build_engine`)."""
    data: DataConfig
    optim: OptimConfig
    run: RunConfig
    dist: DistInfo
    data_path: Path
    meta: Dict[str, Any]
    config: HybridConfig
    train_batches: PackedBatches
    val_batches: List[Dict[str, torch.Tensor]]


def prepare_pretraining(cfg: PretrainConfig) -> PretrainingSetup:
    """Join the process group, prepare the data if needed (rank 0), resolve the model config against the
    tokenizer and open this rank's training / validation batches."""
    data_cfg, optim, run = cfg.data, cfg.optim, cfg.run
    dist = init_distributed()
    optim.gradient_accumulation_steps(dist.world_size)  # fail early, with the field named
    if dist.rank == 0:
        ensure_prepared(data_cfg)
    barrier()
    data_path = Path(data_cfg.path).expanduser()
    meta = read_meta(data_path)
    config = resolve_model_config(cfg.model, meta, data_path)
    config.runtime = cfg.runtime
    train_batches, val_batches = open_splits(data_path, data_cfg.seq_len, optim.micro_batch_size,
                                             data_cfg.val_max_batches, dist.rank, dist.world_size, data_cfg.seed)
    return PretrainingSetup(data_cfg, optim, run, dist, data_path, meta, config, train_batches, val_batches)


def build_engine(setup: PretrainingSetup) -> Engine:
    """The model (identical initial weights on every rank) inside the ZeRO engine, loss = :func:`lm_loss`."""
    seed_everything(setup.optim.seed)
    model = HybridForCausalLM(setup.config)
    return Engine(model, setup.optim,
                  with_nan_faults(lm_loss, setup.optim.gradient_accumulation_steps(setup.dist.world_size)))


def check_sections(sections: Dict[str, Any]) -> PretrainConfig:
    """Every section of the command line and config built (:func:`pretrain_config`) and checked, before anything
    else runs (an already complete run included): keys and values of data / optim / run / runtime, the model
    settings (against the prepared data's tokenizer when the data is there), the data's sources against those it
    was prepared from, and ``run.output_dir``, which must be a directory or not exist."""
    cfg = pretrain_config(sections)
    data_cfg = cfg.data
    out = Path(cfg.run.output_dir).expanduser()
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"run.output_dir: {probe} is a file, expected a directory (or a path that does not "
                          f"exist yet)" + (f" to hold {out}" if probe != out else ""))
    data_path = Path(data_cfg.path).expanduser()
    model = dict(cfg.model)
    if (data_path / "meta.json").is_file():
        if is_rank_zero():
            ensure_prepared(data_cfg)  # prepared already: only checks its sources are those configured
        resolve_model_config(model, read_meta(data_path), data_path)
    else:  # not prepared yet: the vocabulary comes from the tokenizer later; check everything else now
        if model.get("vocab_size", "auto") == "auto":
            model["vocab_size"] = 1 << 17
        HybridConfig.from_user_dict(model)
    return cfg


def completed_result(cfg: PretrainConfig) -> Optional[Dict[str, Any]]:
    """The recorded ``result.json`` of a run that already reached ``optim.max_steps`` (and exported, when
    ``run.export``), or None: rerunning such a run must not resume at its last step, train nothing and
    overwrite its figures with empty ones. ``run.resume: false`` always trains from scratch. ``result.json`` is
    the last file a run writes, after ``final/`` is in place with its completeness marker, which must verify against
    the files it lists (:func:`hybridlm.utils.atomic.is_complete_directory`); a continued run deletes it before it
    trains."""
    optim, run = cfg.optim, cfg.run
    out = Path(run.output_dir)
    if not run.resume or not (out / "result.json").is_file():
        return None
    try:
        result = json.loads((out / "result.json").read_text(encoding="utf-8"))
    except ValueError:
        return None
    if not isinstance(result, dict) or not isinstance(result.get("steps"), int) or result["steps"] < optim.max_steps:
        return None  # stopped early (run.max_minutes) or max_steps raised since: continue it
    if run.export and not (is_complete_directory(out / "final") and (out / "final" / "config.json").is_file()):
        return None
    return result


def sample_text(module, tokenizer, run: RunConfig, eos_token_id) -> str:
    """``run.sample_tokens`` new tokens after ``run.sample_prompt`` through transformers' ``generate``: top-k /
    temperature sampling from a fixed seed (greedy when ``sample_temperature`` is 0), no n-gram repeated, and
    the global RNG left as it was."""
    device = next(module.parameters()).device
    ids = torch.tensor([tokenizer(run.sample_prompt, add_special_tokens=False)["input_ids"]], device=device)
    options = dict(max_new_tokens=run.sample_tokens, attention_mask=torch.ones_like(ids),
                   eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                   no_repeat_ngram_size=run.sample_no_repeat_ngram or None)
    if run.sample_temperature > 0:
        options.update(do_sample=True, temperature=run.sample_temperature, top_k=run.sample_top_k or None)
    else:
        options.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    was_training = module.training
    module.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(run.sample_seed)
            gen = module.generate(ids, **options)
    finally:
        module.train(was_training)
    return tokenizer.decode(gen[0].tolist())


def sample_settings(run: RunConfig, steps: int) -> str:
    """What the sample is, for the line that prints it."""
    how = (f"top-k {run.sample_top_k}, temperature {run.sample_temperature:g}, seed {run.sample_seed}"
           if run.sample_temperature > 0 else "greedy")
    if run.sample_no_repeat_ngram:
        how += f", no repeated {run.sample_no_repeat_ngram}-grams"
    return f"{how}; {steps} steps of training, expect rough text"


def run_pretraining(sections: Dict[str, Any], config_path: Optional[str] = None) -> Dict[str, Any]:
    """Check every section, then run in the run shell (hybridlm/training/shell.py): the run directory's lock, the
    pre-emption signals from start to exit, the export and result committed whole. A complete run is reported
    without taking the lock (it only reads: a read-only mount says so too)."""
    cfg = check_sections(sections)
    done = _already_complete(cfg)
    if done is not None:
        return done
    with RunShell(cfg.run.output_dir) as shell:
        return _pretrain(cfg, shell, config_path)


def _already_complete(cfg: PretrainConfig) -> Optional[Dict[str, Any]]:
    done = completed_result(cfg)
    if done is not None and is_rank_zero():
        out = Path(cfg.run.output_dir)
        print(f"run already complete: {out} finished {done['steps']} steps; nothing to train, its result.json "
              f"is kept (a new run.output_dir or a larger optim.max_steps trains again)", flush=True)
        print(json_text(done), flush=True)
    return done


def _pretrain(cfg: PretrainConfig, shell: RunShell, config_path: Optional[str]):
    done = _already_complete(cfg)  # (completed by another process since the check before the lock)
    if done is not None:
        return done
    if is_rank_zero():  # the run goes on: its completeness marker no longer holds
        with contextlib.suppress(FileNotFoundError):
            os.remove(Path(cfg.run.output_dir).expanduser() / "result.json")
    setup = prepare_pretraining(cfg)
    shell.check("with its data ready, before the model was built (nothing to save yet)")
    data_cfg, optim, run, dist, meta, config = (setup.data, setup.optim, setup.run, setup.dist, setup.meta,
                                                setup.config)
    main = dist.rank == 0
    out = Path(run.output_dir)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        summary = model_summary(config)
        resolved = {"model": config.to_dict(), "data": to_dict(data_cfg), "optim": to_dict(optim), "run": to_dict(run),
                    "runtime": to_dict(config.runtime)}
        write_json(out / "config.resolved.json", resolved, default=str)
        print(json_text({"params": summary["params"], "non_embedding_params": summary["non_embedding_params"],
                          "layer_plan": summary["layer_plan"], "world_size": dist.world_size,
                          "device": str(dist.device), "precision": optim.precision,
                          "tokens_per_step": optim.global_batch_size * data_cfg.seq_len}), flush=True)
    engine = build_engine(setup)
    shell.check("as its engine was built, before the first step (nothing to save yet)")
    train_batches, val_batches = setup.train_batches, setup.val_batches
    outcome = train_loop(engine, train_batches, run, val_batches, title=config_path or "")
    result = {"steps": outcome.steps, "tokens": outcome.tokens, "final_train_loss": outcome.final_loss,
              "val_loss": outcome.val_loss,
              "val_ppl": math.exp(outcome.val_loss) if outcome.val_loss is not None else None,
              "skipped_steps": outcome.skipped_steps, "max_single_step_loss_increase": outcome.max_loss_increase,
              "seconds": round(outcome.seconds, 1)}
    with shell.committing("the export and result.json"):
        if main:
            _commit(engine.module, meta, run, out, config, outcome, result)
    barrier()
    return result


def _commit(module, meta: Dict[str, Any], run: RunConfig, out: Path, config, outcome, result: Dict[str, Any]) -> None:
    """Rank 0: ``final/`` (a transformers model and tokenizer, built aside and renamed into place), the sample, then
    ``result.json``, the run's last file."""
    tokenizer = load_tokenizer(meta["tokenizer"]["path"]) if meta.get("tokenizer", {}).get("path") else None
    if run.export:
        def write(tmp: Path) -> None:
            set_generation_defaults(module, tokenizer)  # pad, eos, greedy in the saved configs
            module.save_pretrained(tmp, remote_code=run.remote_code)
            kill_in("export")  # reliability drills: a kill with the weights written, the tokenizer not
            if tokenizer is not None:
                save_tokenizer(tokenizer, tmp)  # pads on the left
        result["exported_to"] = str(export_model(out / "final", write))
    if run.sample_tokens and tokenizer is not None:
        result["sample"] = sample_text(module, tokenizer, run, config.eos_token_id)
        result["sample_settings"] = sample_settings(run, outcome.steps)
        print(f"sample ({result['sample_settings']}): {result['sample']!r}", flush=True)
    write_json(out / "result.json", result)
    print(json_text(result), flush=True)
