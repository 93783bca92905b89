"""The engine's checkpoints: save, resolve and load, the precision and parameter-group checks, the settings
changed on resume. The files, their manifest, the RNG states and the step counters are
hybridlm/engine/checkpoint.py's; DeepSpeed's own files and the ZeRO-1 resharding of its optimizer state are
hybridlm/engine/deepspeed_adapter.py's, which this store calls as one state among those a checkpoint keeps.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from hybridlm.config.errors import ConfigError
from hybridlm.engine import checkpoint as ckpt
from hybridlm.engine.checkpoint import CheckpointError, StepCounters
from hybridlm.engine.config import OptimConfig
from hybridlm.engine.deepspeed_adapter import MODEL_STATES_FILE, DeepSpeedAdapter, saved_by_bf16_optimizer
from hybridlm.engine.distributed import DistInfo, barrier
from hybridlm.engine.schedule import lr_lambda_from_config
from hybridlm.utils.atomic import TMP_PREFIX, atomic_write_text, disk_full_error, fsync_dir, fsync_tree
from hybridlm.utils.faults import disk_full_in, kill_in

ENGINE_STATE_KEY = "hybridlm_engine"
CLIENT_STATE_KEY = "client_state"


_SIZE_MISMATCH = re.compile(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) "
                            r"from checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")
_KEY_MISMATCH = re.compile(r"(Missing|Unexpected) key\(s\) in state_dict: \"([^\"]+)\"")


def state_dict_mismatch(message: str) -> Optional[str]:
    """The first tensor that torch's ``load_state_dict`` error names (a shape or a key the model and the
    checkpoint disagree on), as a phrase; None for any other error."""
    m = _SIZE_MISMATCH.search(message)
    if m:
        return f"tensor {m.group(1)} has shape {m.group(2)} in the checkpoint, {m.group(3)} in this model"
    m = _KEY_MISMATCH.search(message)
    if m:
        where = "this model has no" if m.group(1) == "Unexpected" else "the checkpoint has no"
        return f"{where} tensor {m.group(2)}"
    return None


# ------------------------------------------------------------------------------------------ store


@dataclass
class Restored:
    """What :meth:`CheckpointStore.load` read besides the DeepSpeed state it put back."""

    client_state: Dict[str, Any]
    counters: StepCounters
    resume_note: Optional[str]  # which settings changed since the save (None: none did)


class CheckpointStore:
    """Atomic, reshardable checkpoints of one DeepSpeed engine (its model, optimizer and schedule), with the
    RNG states and the step counters. Every method is collective: every rank calls it."""

    def __init__(self, deepspeed: DeepSpeedAdapter, config: OptimConfig, dist_info: DistInfo,
                 group_decay: Sequence[float], group_lr: Optional[Sequence[float]] = None,
                 group_layout: Optional[Sequence[Tuple[str, int]]] = None) -> None:
        self.deepspeed = deepspeed
        self.config, self.dist = config, dist_info
        self.group_decay = list(group_decay)  # each param group's weight decay
        self.group_lr = list(group_lr) if group_lr is not None else [config.lr] * len(self.group_decay)
        # each param group's name and size: the optimizer state of a checkpoint fits only the same layout
        self.group_layout = [[str(n), int(c)] for n, c in (group_layout or [])]
        # DeepSpeed's own loader unpickles with weights_only=False: ours reads tensors and plain data only
        deepspeed.load_files_with(ckpt.safe_load)

    def save(self, save_dir: str, step: int, client_state: Optional[Mapping[str, Any]], counters: StepCounters,
             keep_last: Optional[int] = None) -> str:
        """:meth:`hybridlm.engine.Engine.save_checkpoint`; returns the path of the new checkpoint."""
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last: expected a positive integer, got {keep_last!r}")
        save_dir = os.path.abspath(os.fspath(save_dir))
        tmp_tag = TMP_PREFIX + ckpt.step_tag(step)
        tmp_dir = os.path.join(save_dir, tmp_tag)
        rank = self.dist.rank

        if rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            ckpt.remove_stale_temporaries(save_dir)
        barrier()
        # a step saved again (after a resume, or a pre-emption during its save) goes into a fresh directory:
        # the earlier one stays loadable, and named by `latest`, until the new one is committed
        tag = ckpt.free_tag(save_dir, step)
        final_dir = os.path.join(save_dir, tag)

        engine_state = {**dataclasses.asdict(counters), "world_size": self.dist.world_size,
                        "optim": dataclasses.asdict(self.config)}
        state = {
            ENGINE_STATE_KEY: engine_state,
            CLIENT_STATE_KEY: dict(client_state) if client_state is not None else {},
        }
        try:
            self.deepspeed.save(save_dir, tmp_tag, state)
            rng_path = os.path.join(tmp_dir, ckpt.rng_file(rank))
            torch.save(ckpt.get_rng_state(), rng_path)
            disk_full_in("save", step)
            kill_in("save", step)  # reliability drills: a kill with the files written, nothing committed
            barrier()
            if self.dist.local_rank == 0:  # one process per node: covers node-local and shared filesystems
                fsync_tree(tmp_dir)
            barrier()
            if rank == 0:
                ckpt.write_manifest(tmp_dir, {"step": int(step), "world_size": self.dist.world_size, "tag": tag,
                                              "precision": self.config.precision,
                                              "param_groups": self.group_layout})
                fsync_dir(tmp_dir)
        except Exception as e:
            full = disk_full_error(e, tmp_dir, f"the checkpoint save of step {step}")
            if full is None:
                raise
            if rank == 0:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise full from None

        if rank == 0:
            os.rename(tmp_dir, final_dir)  # a name not in use: nothing that `latest` names is touched
            fsync_dir(save_dir)
            kill_in("save-committed", step)
            try:
                disk_full_in("save-latest", step)
                atomic_write_text(os.path.join(save_dir, ckpt.LATEST), tag + "\n")  # the commit point
            except Exception as e:
                full = disk_full_error(e, final_dir, f"the checkpoint save of step {step}")
                if full is None:
                    raise
                shutil.rmtree(final_dir, ignore_errors=True)  # never named: `latest` still names the one before
                raise full from None
            kill_in("save-latest", step)
            ckpt.remove_superseded(save_dir, tag)
            if keep_last is not None:
                ckpt.prune(save_dir, keep_last, protect=tag)
        barrier()
        return final_dir

    def resolve(self, path: str, required: bool) -> Optional[Tuple[str, str]]:
        """``(save_dir, tag)`` to load from ``path`` (a save dir or a ``step_<N>`` dir), or None."""
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {path}: does not exist")
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint {path}: is not a directory")
        if os.path.isfile(os.path.join(path, ckpt.MANIFEST)) or os.path.isfile(
            os.path.join(path, MODEL_STATES_FILE)
        ):
            parent, tag = os.path.split(path)
            return parent, tag
        tag = ckpt.read_latest(path)
        if tag is None:
            # a save killed between its rename and the first `latest`: a step directory is complete once renamed
            # (its manifest is written before), so the newest one is where the run stands
            complete = [p for _step, p in ckpt.list_step_dirs(path)
                        if os.path.isfile(os.path.join(p, ckpt.MANIFEST))]
            if complete:
                return path, os.path.basename(complete[-1])
            if required or ckpt.list_step_dirs(path):
                raise CheckpointError(f"checkpoint {path}: no '{ckpt.LATEST}' file naming a complete checkpoint")
            return None
        tag_dir = os.path.join(path, tag)
        if not os.path.isdir(tag_dir):
            raise CheckpointError(f"checkpoint {path}: '{ckpt.LATEST}' names {tag!r}, which does not exist")
        return path, tag

    def load(self, path: str, required: bool = False) -> Optional[Restored]:
        """:meth:`hybridlm.engine.Engine.load_checkpoint`: the model, optimizer, schedule and RNG states put
        back; None when ``path`` holds no checkpoint yet (unless ``required``)."""
        path = os.path.abspath(os.fspath(path))
        resolved = self.resolve(path, required)
        if resolved is None:
            return None
        save_dir, tag = resolved
        tag_dir = os.path.join(save_dir, tag)
        manifest = ckpt.read_manifest(tag_dir)
        self.check_precision(tag_dir, manifest)
        self.check_param_groups(tag_dir, manifest)
        saved_ws = manifest.get("world_size")
        if isinstance(saved_ws, bool) or not isinstance(saved_ws, int) or saved_ws < 1:
            raise CheckpointError(f"checkpoint {tag_dir}: manifest has no valid world_size ({saved_ws!r})")
        resharded = saved_ws != self.dist.world_size
        # a rank that did not exist at the save starts from rank 0's generators
        rng_rank = self.dist.rank if self.dist.rank < saved_ws else 0
        rng_path = os.path.join(tag_dir, ckpt.rng_file(rng_rank))
        try:
            # another number of ranks: DeepSpeed loads the model and the schedule, the optimizer state is
            # re-partitioned from every saved shard below (DeepSpeedAdapter.load_resharded_optimizer)
            load_path, state = self.deepspeed.load(save_dir, tag, with_optimizer=not resharded)
            if resharded and load_path is not None:
                self.deepspeed.load_resharded_optimizer(tag_dir, saved_ws, ckpt.safe_load)
            rng = ckpt.safe_load(rng_path)
        except CheckpointError:
            raise
        except Exception as e:  # torch/pickle/DeepSpeed errors on a damaged checkpoint
            mismatch = state_dict_mismatch(str(e))
            if mismatch:
                raise CheckpointError(f"checkpoint {tag_dir}: {mismatch}; the model settings changed since the save "
                                      f"(resume with the settings it was saved with, or start a new "
                                      f"run.output_dir)") from None
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CheckpointError(f"checkpoint {tag_dir}: could not be loaded ({type(e).__name__}: {msg})") from e
        if load_path is None or state is None or ENGINE_STATE_KEY not in state:
            raise CheckpointError(f"checkpoint {tag_dir}: not a checkpoint written by hybridlm.engine")
        es = state[ENGINE_STATE_KEY]
        counters = StepCounters(int(es["global_step"]), int(es["skipped_steps"]), int(es["consecutive_nonfinite"]))
        ckpt.set_rng_state(rng)
        note = self.apply_settings(es.get("optim") or {}, counters.global_step)
        barrier()
        return Restored(state.get(CLIENT_STATE_KEY, {}), counters, note)

    def check_precision(self, tag_dir: str, manifest: Mapping[str, Any]) -> None:
        """Refuse, naming the setting, a checkpoint saved with another ``optim.precision`` (its optimizer files
        are another kind: bf16 runs save ``bf16_zero_pp_rank_*``)."""
        saved = manifest.get("precision")
        now = self.config.precision
        if saved is None:  # an older manifest: the kind of its optimizer files tells bf16 from the others
            names = manifest.get("files") or {}
            bf16_files = saved_by_bf16_optimizer(names)
            if bf16_files == (now == "bf16"):
                return
            saved = "bf16" if bf16_files else "fp32 or bf16-mixed"
        if saved != now:
            raise CheckpointError(f"checkpoint {tag_dir}: saved with optim.precision={saved}, this run has "
                                  f"optim.precision={now}; resume with optim.precision={saved}, or start a new "
                                  f"run.output_dir")

    def check_param_groups(self, tag_dir: str, manifest: Mapping[str, Any]) -> None:
        """Refuse a checkpoint whose optimizer groups hold other parameters (a group frozen or unfrozen by
        ``optim.group_lr`` since the save): its optimizer state has no place in this run's groups."""
        saved = manifest.get("param_groups")
        # the same groups with other sizes is another model shape: the model's own load names the tensor
        if saved is None or [g[0] for g in saved] == [g[0] for g in self.group_layout]:
            return
        def names(layout):
            return ", ".join(f"{n or 'all'} ({c} params)" for n, c in layout) or "none"
        raise CheckpointError(f"checkpoint {tag_dir}: saved with the trained parameter groups {names(saved)}, this "
                              f"run trains {names(self.group_layout)}; resume with the optim.group_lr it was saved "
                              f"with (the same groups at 0), or start a new run.output_dir")

    def apply_settings(self, saved: Mapping[str, Any], global_step: int) -> Optional[str]:
        """After a load: the learning rate of the next step from this run's schedule (``optim.lr``, ``min_lr``,
        ``warmup_steps``, ``max_steps``) at the number of updates applied so far, and this run's ``weight_decay``,
        ``betas`` and ``eps`` in the optimizer's groups; DeepSpeed's load put back the saved ones. The saved
        settings and the new ones are never blended: a changed setting applies from the resume step on, and
        the returned line says which changed (None when none did). ``global_step``: the steps loaded."""
        cfg = self.config
        applied = self.deepspeed.applied_updates
        factor = lr_lambda_from_config(cfg)
        lrs = [base * factor(applied) for base in self.group_lr]
        self.deepspeed.set_optimizer_settings(self.group_lr, lrs, self.group_decay, cfg.betas, cfg.eps)
        changed = []
        for key in ("lr", "group_lr", "min_lr", "warmup_steps", "max_steps", "schedule", "decay_fraction",
                    "weight_decay", "betas", "eps", "grad_clip"):
            if key not in saved:
                continue
            old, new = saved[key], getattr(cfg, key)
            if isinstance(old, (list, tuple)):
                old, new = list(old), list(new)
            if old != new:
                changed.append(f"optim.{key} {old} -> {new}")
        if not changed:
            return None
        return (f"resumed with changed settings: {', '.join(changed)}; the new settings apply from step "
                f"{global_step + 1} on (its lr {cfg.lr * factor(applied):.6g}: this run's schedule at {applied} applied updates), "
                f"the steps before it kept the old ones")
