"""Tiny language model + data shared by tests/test_engine.py, and a multi-process worker.

As a script it is launched by the test under ``torchrun --nproc_per_node 2`` (or the ``deepspeed``
launcher); each rank trains the tiny model with :class:`hybridlm.engine.Engine` and writes
``<out>/rank<R>.json`` with its per-step losses, a hash of its parameters, and how much of the
optimizer state it holds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 32
SEQ = 9  # tokens per sequence (8 predictions)


class TinyLM(nn.Module):
    """Embedding + learned positions + 2-layer MLP + LayerNorm + LM head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, seq: int = SEQ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.pos._no_weight_decay = True  # 2-D but excluded from weight decay by tag
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids) + self.pos[: input_ids.shape[1]].to(self.emb.weight.dtype)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.head(self.norm(h))


def build_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def loss_fn(model: nn.Module, batch: Dict[str, Any]):
    """Next-token cross-entropy.  ``batch["poison"]`` (optional, a bool tensor) makes the loss NaN."""
    ids = batch["input_ids"]
    logits = model(ids[:, :-1]).float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    poison = batch.get("poison")
    if poison is not None:
        loss = loss * torch.where(poison, float("nan"), 1.0)
    return loss, {"ppl": loss.detach().exp(), "tokens": ids[:, 1:].numel()}


def global_batches(steps: int, global_batch_size: int, seed: int = 1234) -> List[torch.Tensor]:
    """Learnable sequences: a random start token, then +1 or +3 (mod VOCAB) depending on the row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (global_batch_size, 1), generator=g)
        stride = 1 + 2 * (torch.arange(global_batch_size).unsqueeze(1) % 2)
        out.append((start + stride * torch.arange(SEQ).unsqueeze(0)) % VOCAB)
    return out


def local_micro_batches(
    batch: torch.Tensor, rank: int, world: int, micro: int, poison_rows: Sequence[int] = ()
) -> List[Dict[str, torch.Tensor]]:
    """This rank's share of a global batch, cut into micro-batches (a micro-batch holding a
    ``poison_rows`` row gets a NaN loss).  Rank r of W holds rows [r*G/W, (r+1)*G/W)."""
    per_rank = batch.shape[0] // world
    lo = rank * per_rank
    out = []
    for start in range(lo, lo + per_rank, micro):
        rows = range(start, start + micro)
        mb = {"input_ids": batch[start : start + micro]}
        if any(r in poison_rows for r in rows):
            mb["poison"] = torch.tensor(True)
        out.append(mb)
    return out


def params_digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def optimizer_shard_info(engine) -> Dict[str, int]:
    """How much fp32 master weight / AdamW state this rank holds (ZeRO partitions)."""
    zopt = engine.optimizer
    parts = getattr(zopt, "single_partition_of_fp32_groups", None)
    if parts is None:  # bf16 with fp32 grad accumulation: DeepSpeed's BF16_Optimizer (ZeRO-1)
        parts = zopt.fp32_groups_flat_partition
    state = engine.ds_engine.basic_optimizer.state
    return {
        "optimizer_class": type(zopt).__name__,
        "trainable_numel": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
        "master_numel": sum(int(p.numel()) for p in parts),
        "master_dtype": str(parts[0].dtype),
        "exp_avg_numel": sum(int(s["exp_avg"].numel()) for s in state.values() if "exp_avg" in s),
        "exp_avg_sq_numel": sum(int(s["exp_avg_sq"].numel()) for s in state.values() if "exp_avg_sq" in s),
        "partition_count": len(parts),
    }


def make_config(precision: str = "fp32", **kw):
    """The tiny runs' optim config; ``precision="bf16-device"`` is bf16 with ``step_on_device``."""
    from hybridlm.engine import OptimConfig

    if precision == "bf16-device":
        precision, kw = "bf16", {"step_on_device": True, **kw}
    base = dict(micro_batch_size=2, global_batch_size=4, lr=1e-2, min_lr=1e-3, warmup_steps=2, max_steps=20,
                precision=precision, max_consecutive_nonfinite=3)
    base.update(kw)
    return OptimConfig(**base)


def first_moment_norm(engine) -> float:
    """The L2 norm of AdamW's ``exp_avg`` over every rank's partition. After one step from a fresh optimizer it
    is (1 - beta1) times the norm of the gradient the step used: the clipped one."""
    from hybridlm.engine import all_reduce_sum

    opt = engine.ds_engine.basic_optimizer
    local = sum(float(opt.state[p]["exp_avg"].double().square().sum())
                for g in opt.param_groups for p in g["params"] if "exp_avg" in opt.state[p])
    return math.sqrt(all_reduce_sum([local])[0])


CLIP_TEST = 1e-3  # far below the tiny model's gradient norm: every step clips


def run(engine, batches: Sequence[torch.Tensor], rank: int, world: int, poison: Dict[int, Sequence[int]]):
    """Train one step per global batch; ``poison[step_index]`` = rows whose micro-batch gets a NaN loss."""
    results = []
    micro = engine.config.micro_batch_size
    for i, b in enumerate(batches):
        results.append(engine.train_step(local_micro_batches(b, rank, world, micro, poison.get(i, ()))))
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-at", type=int, default=3)
    ap.add_argument("--nan-step", type=int, default=2, help="step index whose rank-1 rows get a NaN loss")
    ap.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    ap.add_argument("--resume-from", default=None, help="only resume this checkpoint (saved at --save-at, maybe "
                    "on another number of ranks), train the remaining steps and write the losses")
    args = ap.parse_args(argv)

    from hybridlm.engine import Engine, all_reduce_flag, all_reduce_sum, init_distributed, is_main

    info = init_distributed()
    cfg = make_config(args.precision)
    batches = global_batches(args.steps, cfg.global_batch_size)
    if args.resume_from:
        engine = Engine(build_model(seed=99), cfg, loss_fn)
        client = engine.load_checkpoint(args.resume_from, required=True)
        res = run(engine, batches[args.save_at:], info.rank, info.world_size, {})
        with open(os.path.join(args.out, f"rank{info.rank}.json"), "w") as f:
            json.dump({"rank": info.rank, "world_size": info.world_size, "client": client,
                       "global_step": engine.global_step, "losses": [r.loss for r in res],
                       "params_digest": params_digest(engine.module)}, f)
        engine.ds_engine.destroy()
        del engine
        close(args.out, info.rank)
        return
    poison = {args.nan_step: [2, 3]}  # rows 2-3 live on rank 1 only

    engine = Engine(build_model(seed=0), cfg, loss_fn)
    ckpt_dir = os.path.join(args.out, "ckpt")
    res = run(engine, batches[: args.save_at], info.rank, info.world_size, poison)
    engine.save_checkpoint(ckpt_dir, args.save_at, {"where": "worker"})
    res += run(engine, batches[args.save_at :], info.rank, info.world_size,
               {k - args.save_at: v for k, v in poison.items()})
    final_digest = params_digest(engine.module)
    shard = optimizer_shard_info(engine)

    # A fresh engine (different init) resumed from the checkpoint must continue identically.
    resumed = Engine(build_model(seed=99), cfg, loss_fn)
    client = resumed.load_checkpoint(ckpt_dir, required=True)
    res2 = run(resumed, batches[args.save_at :], info.rank, info.world_size,
               {k - args.save_at: v for k, v in poison.items()})

    # a step that clips: the first moment must hold the gradient scaled to the global norm CLIP_TEST
    clipping = Engine(build_model(seed=0), make_config(args.precision, grad_clip=CLIP_TEST), loss_fn)
    clip_res = run(clipping, batches[:1], info.rank, info.world_size, {})

    out = {
        "clip": {"grad_norm": clip_res[0].grad_norm, "first_moment_norm": first_moment_norm(clipping)},
        "rank": info.rank,
        "world_size": info.world_size,
        "backend": info.backend,
        "is_main": is_main(),
        "flag_any": all_reduce_flag(info.rank == 1),
        "flag_none": all_reduce_flag(False),
        "sum": all_reduce_sum([info.rank, 1.0]),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        "losses": [r.loss for r in res],
        "grad_norms": [r.grad_norm for r in res],
        "skipped": [r.skipped for r in res],
        "lrs": [r.lr for r in res],
        "tokens": [r.tokens for r in res],
        "skipped_steps": engine.skipped_steps,
        "params_digest": final_digest,
        "shard": shard,
        "resumed_client_state": client,
        "resumed_losses": [r.loss for r in res2],
        "resumed_params_digest": params_digest(resumed.module),
        "ckpt_files": sorted(os.listdir(os.path.join(ckpt_dir, f"step_{args.save_at}"))),
    }
    with open(os.path.join(args.out, f"rank{info.rank}.json"), "w") as f:
        json.dump(out, f)
    engine.ds_engine.destroy()
    resumed.ds_engine.destroy()
    clipping.ds_engine.destroy()
    del engine, resumed, clipping
    close(args.out, info.rank)


GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")  # each gloo process group runs one of the first, two of the second


def thread_names() -> List[str]:
    """Names of this process's threads (Linux: /proc/self/task/*/comm)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(names)


def close(out: Optional[str] = None, rank: int = 0) -> None:
    """Every process group torn down once the engines are released (their DeepSpeed optimizers hold the
    data-parallel group): gloo threads of a group still referenced at interpreter teardown can abort the rank
    (hybridlm/engine/distributed.py, _destroy_groups). No ``gc.collect()`` here: ``shutdown_distributed()`` alone
    must free the groups of released engines. Writes ``<out>/rank<R>_teardown.json`` with the threads left after
    it, which must include no gloo thread."""
    from hybridlm.engine import shutdown_distributed
    shutdown_distributed()
    if out is not None:
        with open(os.path.join(out, f"rank{rank}_teardown.json"), "w") as f:
            json.dump({"rank": rank, "threads_after_shutdown": thread_names()}, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
