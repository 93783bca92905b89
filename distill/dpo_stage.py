"""DPO stage: the KD-SFT student is the policy; a second, frozen copy of it is the reference (the published upcycling recipe; README, "Upcycling a Llama").

Sections: ``student`` (the policy's starting point and the reference: a directory from ``upcycle kd`` or
``upcycle init``; its tokenizer is used), ``data`` (:class:`PreferenceDataConfig`: preference pairs in any
layout :func:`distill.preference_data.load_preference_data` reads), ``optim``, ``run`` and ``dpo``
(:class:`DPOConfig`: ``beta``). A DPO config has no ``teacher`` section.

Loss: :func:`distill.dpo.dpo_loss` (sigmoid, checked against trl) on sequence log-probs summed over the
answer tokens (:func:`distill.dpo.sequence_logps`); chosen and rejected run as one ``[chosen; rejected]``
batch (:func:`distill.preference_data.collate_pairs`). Logged per step with trl's names:
``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``. At step 1 the policy equals the reference, so the loss is log 2 (exactly, with
deterministic kernels).

Held-out evaluation: the shared loop's evaluation averages the loss and every metric over the held-out pairs
(the loss weighs them by pairs through ``eval_weight``) and logs them as ``val_*`` keys; its final one gives
``eval`` = {pairs, loss, rewards/accuracies, rewards/margins, rewards/chosen, rewards/rejected} (pair means
over every rank), added to ``final/stage.json``.

Published settings: beta 0.01, lr 5e-7, cosine, 10% warmup, 1 epoch, max_length 1024,
max_prompt_length 512 (set ``optim.max_steps`` to pairs / global batch for one epoch).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Dict

import torch

from distill.dpo import METRIC_KEYS, dpo_loss, sequence_logps
from distill.preference_data import collate_pairs, load_preference_data, tokenize_pair
from distill.stage import amend_stage_result, run_stage, stage_configs
from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import Section, setting, to_dict
from hybridlm.data.sft import (ExampleBatches, SFTDataConfig, pad_token_id, split_records,
                               validation_example_batches)
from hybridlm.engine import init_distributed
from hybridlm.engine.config import COMPUTE_DTYPES
from hybridlm.model import HybridForCausalLM

DPO_SECTIONS = ("student", "data", "optim", "run", "runtime", "dpo")
EVAL_KEYS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")


@dataclass
class DPOConfig(Section):
    """The ``dpo:`` section."""

    beta: float = setting(0.01, gt=0)  # published


@dataclass
class PreferenceDataConfig(SFTDataConfig):
    """The ``data:`` section of a DPO stage: a preference ``.json`` / ``.jsonl`` file tokenized on load with the
    student's tokenizer (:func:`distill.preference_data.tokenize_pair`). ``val_fraction`` of the pairs
    (seeded, pair-level split) are held out."""

    max_length: int = setting(1024, ge=2)
    max_prompt_length: int = setting(512, ge=1)  # below max_length (validate)

    def validate(self, where: str = "data") -> None:
        super().validate(where)
        if self.max_prompt_length >= self.max_length:
            raise ConfigError(f"{where}.max_prompt_length: expected an integer in [1, max_length={self.max_length}), "
                              f"got {self.max_prompt_length!r}")


def make_preference_batches(data_cfg: PreferenceDataConfig, optim, dist, tokenizer):
    """``run_stage``'s ``make_batches`` for DPO: (resumable pair iterator, validation batch list). A micro-batch
    of ``micro_batch_size`` pairs is one ``(2 * micro_batch_size, T)`` ``[chosen; rejected]`` batch."""

    pairs = load_preference_data(data_cfg.path)
    train_idx, val_idx = split_records(len(pairs), data_cfg.val_fraction, data_cfg.seed)
    tok = {s: [tokenize_pair(tokenizer, pairs[int(i)], data_cfg.max_length, data_cfg.max_prompt_length) for i in idx]
           for s, idx in (("train", train_idx), ("val", val_idx))}
    collate = partial(collate_pairs, pad_token_id=pad_token_id(tokenizer))
    train = ExampleBatches(tok["train"], optim.micro_batch_size, dist.rank, dist.world_size, data_cfg.seed, collate,
                           name="preference data")
    val = validation_example_batches(tok["val"], optim.micro_batch_size, data_cfg.val_max_batches, dist.rank,
                                     dist.world_size, collate, name="preference validation data")
    if dist.rank == 0:
        print(f"preference data {data_cfg.path}: {len(tok['train'])} train / {len(tok['val'])} val pairs", flush=True)
    return train, val


class DPOLoss:
    """``loss_fn(policy, batch)`` for the engine: the DPO loss and trl's metrics of one batch of pairs, weighted
    by pairs in the loop's evaluation (``eval_weight``)."""

    def __init__(self, reference: torch.nn.Module, beta: float):
        self.reference, self.beta = reference, beta

    def __call__(self, policy, batch: Dict[str, torch.Tensor]):
        ids, labels = batch["input_ids"], batch["labels"]
        n = ids.shape[0] // 2
        logps = sequence_logps(policy(input_ids=ids).logits, labels)
        with torch.no_grad():
            ref = sequence_logps(self.reference(input_ids=ids).logits, labels)
        loss, metrics = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], self.beta)
        mask = batch.get("attention_mask")
        tokens = mask.sum() if mask is not None else ids.numel()
        return loss, {**{k: metrics[k] for k in METRIC_KEYS}, "tokens": tokens, "eval_weight": n}


def dpo_configs(sections: Dict[str, Any], where: str = "") -> Dict[str, Any]:
    """A DPO stage's sections built (:func:`distill.stage.stage_configs`); it has no ``teacher``."""
    if sections.get("teacher"):
        raise ConfigError(f"{where}teacher: DPO has no teacher (the reference is a frozen copy of student.path); "
                          "remove the teacher section")
    return stage_configs(sections, PreferenceDataConfig, {"dpo": DPOConfig}, teacher=False, where=where)


def run_dpo(configs: Dict[str, Any]) -> Dict[str, Any]:
    """DPO of the student directory against a frozen copy of itself, with the built sections
    (:func:`dpo_configs`); every policy parameter trains."""

    cfg, student, optim, run = configs["dpo"], configs["student"], configs["optim"], configs["run"]

    def make_loss(_none):
        dist = init_distributed()
        dtype = getattr(torch, COMPUTE_DTYPES[optim.precision])
        reference = HybridForCausalLM.from_pretrained(student.path, runtime=configs["runtime"])
        reference = reference.to(device=dist.device, dtype=dtype).eval()
        reference.requires_grad_(False)
        return DPOLoss(reference, cfg.beta)

    result = run_stage("dpo", configs, make_loss, lambda policy: policy.parameters(),
                       make_batches=make_preference_batches)
    extra: Dict[str, Any] = {"reference": student.path}
    val = result.get("val") or {}
    if val.get("val_count"):  # the loop's final evaluation (logged to metrics.jsonl as val_* by its logger)
        extra["eval"] = {"pairs": int(round(val["val_count"])), "loss": val["val_loss"],
                         **{k: val[f"val_{k}"] for k in EVAL_KEYS}}
    return amend_stage_result(run.output_dir, extra, {"dpo": to_dict(cfg)}, result)


