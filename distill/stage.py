"""One distillation stage on the shared engine: frozen teacher + student directory -> trained student.

A stage config has sections ``teacher`` (path), ``student`` (path), ``data`` (a :class:`DataConfig`,
prepared with the teacher's tokenizer), ``optim`` and ``run``. The stage is resumable (the shared loop's
checkpoints) and idempotent: a finished stage is skipped, and its resume checkpoints are removed once ``final/`` is
written. Finished means a verified export: ``final/.complete`` lists every file of ``final/`` with its size and
they all match (:func:`hybridlm.utils.atomic.verify_complete_directory`), ``final/stage.json`` its record. A
``final/`` that does not verify is redone from the stage's last checkpoint, or, with none left, refused in one
line; a finished stage is reported finished without taking the lock (a read-only mount included).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional

import torch

from distill.ild import ild_loss
from distill.param_groups import GROUPS, student_param_groups
from hybridlm.config.errors import ConfigError, last_line, weight_load_errors
from hybridlm.config.structured import Section, build_dataclass, check_known_keys, setting, to_dict
from hybridlm.data import DataConfig, ensure_prepared, load_tokenizer, open_splits, read_meta
from hybridlm.engine import Engine, OptimConfig, barrier, init_distributed, is_main
from hybridlm.engine.checkpoint import LATEST
from hybridlm.engine.config import COMPUTE_DTYPES
from hybridlm.model import HybridForCausalLM
from hybridlm.model.runtime import RuntimeSettings
from hybridlm.teacher import check_tokenizer_matches, load_teacher, load_teacher_tokenizer
from hybridlm.training import RunConfig, train_loop
from hybridlm.training.shell import RunShell, export_model
from hybridlm.utils.atomic import json_text, verify_complete_directory, write_json
from hybridlm.utils.faults import term_in

STAGE_SECTIONS = ("teacher", "student", "data", "optim", "run", "runtime")


@dataclass
class TeacherConfig(Section):
    path: str = "asset:smollm2"
    dtype: str = "auto"  # auto: the dtype the student computes in (bf16 for bf16 / bf16-mixed, else fp32)


@dataclass
class StudentConfig(Section):
    path: str = setting("", nonempty="the directory of a student written by `upcycle init`")


def _done_file(run: RunConfig) -> Path:
    return Path(run.output_dir) / "final" / "stage.json"


def finished_stage(run: RunConfig) -> Optional[Dict[str, Any]]:
    """The stage's record (``final/stage.json``) when ``final/`` is a verified export, else None."""
    done = _done_file(run)
    if verify_complete_directory(done.parent) is not None:
        return None
    try:
        result = json.loads(done.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def check_unfinished_export(run: RunConfig) -> None:
    """A ``final/`` that is not a verified export is redone from the stage's last checkpoint (the export replaces it
    whole); with no checkpoint left to redo it from, ConfigError in one line: it is never trained over silently."""
    final = _done_file(run).parent
    why = verify_complete_directory(final)
    if not final.exists() or why is None or (run.checkpoint_dir / LATEST).exists():
        return
    raise ConfigError(f"run.output_dir: {final} is not a verified export ({why}) and no checkpoint is left in "
                      f"{run.checkpoint_dir} to redo it from; move {final} aside to train the stage again")


def packed_lm_batches(data_cfg: DataConfig, optim: OptimConfig, dist, tokenizer, splits: Callable = open_splits):
    """Default batch source: packed token windows (prepared with the teacher's tokenizer on rank 0); ``splits``
    opens the prepared directory (:func:`hybridlm.data.document_windows.open_document_splits`: windows inside one
    document)."""
    if dist.rank == 0:
        if data_cfg.tokenizer == "teacher":
            data_cfg.tokenizer = str(Path(tokenizer.name_or_path))
        ensure_prepared(data_cfg)
    barrier()
    check_tokenizer_matches(tokenizer, load_tokenizer(read_meta(data_cfg.path)["tokenizer"]["path"]))
    return splits(data_cfg.path, data_cfg.seq_len, optim.micro_batch_size, data_cfg.val_max_batches,
                  dist.rank, dist.world_size, data_cfg.seed)


def stage_configs(sections: Dict[str, Any], data_class: type = DataConfig, extra: Optional[Dict[str, type]] = None,
                  teacher: bool = True, where: str = "") -> Dict[str, Any]:
    """Every section of a training stage built into its dataclass: the one schema of a stage's config, which the
    stage runs with and the route checks before its first stage. ``extra``: the stage's own sections (``kd``,
    ``dpo``); ``where``: the prefix of error messages (``"kd."`` in a route)."""
    # the stage's own sections first: their errors are the ones a user of that stage looks for
    schema = {**(extra or {}), **({"teacher": TeacherConfig} if teacher else {}), "student": StudentConfig,
              "data": data_class, "optim": OptimConfig, "run": RunConfig, "runtime": RuntimeSettings}
    check_known_keys(where.rstrip(".") or "config", sections, schema)
    built = {key: build_dataclass(cls, sections.get(key) or {}, f"{where}{key}") for key, cls in schema.items()}
    check_group_lr(built["optim"], f"{where}optim")
    return built


def check_group_lr(optim: OptimConfig, where: str) -> None:
    """``optim.group_lr`` names only a student's parameter groups and leaves one training, checked with the config
    (the engine would say so only once the models are loaded, in a route after every stage before it)."""
    unknown = sorted(set(optim.group_lr) - set(GROUPS))
    if unknown:
        raise ConfigError(f"{where}.group_lr.{unknown[0]}: not a parameter group of a student; expected one of "
                          f"{', '.join(GROUPS)}")
    if all(optim.lr_of(group) == 0 for group in GROUPS):
        raise ConfigError(f"{where}.group_lr: every parameter group is frozen ({optim.group_lr}); nothing trains")


def ild_configs(sections: Dict[str, Any], where: str = "") -> Dict[str, Any]:
    return stage_configs(sections, where=where)


def run_stage(name: str, configs: Dict[str, Any],
              make_loss: Callable[[Any], Callable],
              trainable: Callable[[Any], Iterable[torch.nn.Parameter]],
              make_batches: Callable = packed_lm_batches) -> Dict[str, Any]:
    """Train the student with ``make_loss(teacher)`` over ``trainable(student)`` params; export ``final/``.

    ``configs``: the stage's sections built by :func:`stage_configs`. ``make_batches(data_cfg, optim, dist,
    teacher_tokenizer) -> (train iterator with state_dict / load_state_dict, list of validation batches)``
    supplies the data (default: packed LM windows). ``make_loss`` receives the frozen teacher (a
    LlamaForCausalLM for KD / ILD; None for a stage without a teacher: DPO brings its own frozen reference)."""

    run = configs["run"]
    result = _skipped(name, run)  # a finished stage only reads: no lock, so a read-only mount says so too
    if result is not None:
        return result
    with RunShell(run.output_dir) as shell:
        return _run_stage(name, configs, make_loss, trainable, make_batches, shell)


def _skipped(name: str, run: RunConfig) -> Optional[Dict[str, Any]]:
    result = finished_stage(run)
    if result is not None:
        print(f"{name}: already finished in {_done_file(run).parent} (its export verified); skipped", flush=True)
    return result


def _run_stage(name, configs, make_loss, trainable, make_batches, shell: RunShell) -> Dict[str, Any]:
    # a stage without a teacher (DPO) reads the tokenizer from the student's own directory
    teacher_cfg = configs.get("teacher")
    student_cfg, data_cfg, optim, run = configs["student"], configs["data"], configs["optim"], configs["run"]
    done = _done_file(run)
    result = _skipped(name, run)  # (finished by another process since the check before the lock)
    if result is not None:
        return result
    check_unfinished_export(run)
    student_dir = Path(student_cfg.path)
    if not (student_dir / "config.json").is_file():
        raise ConfigError(f"student.path: {student_dir} has no config.json (expected a directory from `upcycle init`)")
    dist = init_distributed()
    teacher_tok = load_teacher_tokenizer(teacher_cfg.path if teacher_cfg else student_cfg.path)
    train_batches, val_batches = make_batches(data_cfg, optim, dist, teacher_tok)
    shell.check(f"before the {name} stage's models were loaded (nothing to save yet)")
    teacher = None
    if teacher_cfg:
        dtype = getattr(torch, COMPUTE_DTYPES[optim.precision] if teacher_cfg.dtype == "auto" else teacher_cfg.dtype)
        teacher = load_teacher(teacher_cfg.path, dtype=dtype).to(dist.device)
        teacher.requires_grad_(False)
        shell.check(f"after the {name} stage's teacher was loaded (nothing to save yet)")
    try:
        term_in("load")  # reliability drills: a signal inside a load that catches broad errors
        student = HybridForCausalLM.from_pretrained(student_dir, runtime=configs["runtime"])
    except weight_load_errors() as e:
        raise ConfigError(f"student.path: {student_dir} cannot be loaded as a hybrid ({last_line(e)})") from None
    shell.check(f"after the {name} stage's student was loaded (nothing to save yet)")
    loss_fn = make_loss(teacher)
    # trainable parameters by group (inherited / mixer / latent): optim.group_lr sets a group's lr, 0 freezes it
    engine = Engine(student, optim, lambda model, batch: loss_fn(model.module, batch),
                    named_groups=student_param_groups(student, trainable(student)))
    shell.check(f"as the {name} stage's engine was built, before its first step (nothing to save yet)")
    outcome = train_loop(engine, train_batches, run, val_batches, title=f"{name}: {student_dir.name}",
                         loss_is_nll=False)
    result = {"stage": name, "student": str(student_dir), "teacher": teacher_cfg.path if teacher_cfg else None,
              "steps": outcome.steps, "tokens": outcome.tokens, "final_loss": outcome.final_loss,
              "val_loss": outcome.val_loss, "val": outcome.val,
              "seconds": round(outcome.seconds, 3), "seconds_per_step": outcome.seconds_per_step,
              "config": {"data": to_dict(data_cfg), "optim": to_dict(optim)}}
    with shell.committing(f"the {name} stage's export"):
        if dist.rank == 0:
            def write(tmp: Path) -> None:
                engine.module.save_pretrained(tmp, remote_code=run.remote_code)
                teacher_tok.save_pretrained(tmp)
                write_json(tmp / "stage.json", result)  # the stage's completeness record, in the same rename
            export_model(done.parent, write, f"the {name} stage's export", amendable=("stage.json",))
            print(json_text({k: v for k, v in result.items() if k != "config"}), flush=True)
        barrier()
    if dist.rank == 0 and run.checkpoint_dir.exists():
        # a finished stage is skipped on rerun, so its resume checkpoints (optimizer state: ~12 bytes per
        # parameter) are dead weight once final/ is complete
        shutil.rmtree(run.checkpoint_dir, ignore_errors=True)
    return result


def run_ild(configs: Dict[str, Any]) -> Dict[str, Any]:
    """Intermediate Layer Distillation of the built sections (:func:`ild_configs`): every decoder-layer parameter
    trains; embeddings and head stay frozen."""

    def make_loss(teacher):
        return lambda student, batch: ild_loss(student, teacher, batch["input_ids"])

    return run_stage("ild", configs, make_loss, lambda student: student.model.layers.parameters())


# ------------------------------------------------------------------------------------- stage
def amend_stage_result(output_dir, extra: Dict[str, Any], config_extra: Optional[Dict[str, Any]] = None,
                       result: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Add keys to ``output_dir/final/stage.json`` (rank 0 writes, atomically) and to ``result``.

    ``config_extra`` goes under ``result["config"]`` and is only added when absent, so a skipped (already
    finished) stage keeps recording the settings it actually ran with."""
    done = Path(output_dir) / "final" / "stage.json"
    result = dict(result or {})
    changed = False
    for k, v in (config_extra or {}).items():
        cfg = result.setdefault("config", {})
        if k not in cfg:
            cfg[k] = v
            changed = True
    for k, v in extra.items():
        if result.get(k) != v:
            result[k] = v
            changed = True
    if changed and is_main() and done.is_file():
        write_json(done, result)
    barrier()
    return result
