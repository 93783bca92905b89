"""Does our Mamba2 compute what transformers' Mamba2 computes from the same weights, in bf16 as in fp32?

Builds the loss-parity peer (transformers' ``Mamba2ForCausalLM`` with the chunked SSD, seed 0) and ours holding
its exact initial weights (``--ours-init peer``), and on one training batch measures the loss and the gradients
of each model in fp32 and under bf16 autocast, for ours also with the Mamba2 layer's precision choices changed
(the variants below). Each bf16 gradient is compared with the same model's fp32 gradient (its own rounding
error) and ours' with the peer's (the same function?). On a GPU both run their Triton paths; on a CPU the torch
paths (slow at the 300M shape: use ``--model-override``).

    python scripts/probes/mamba2_same_weights.py --data data_cache/janeausten-llama3.2 [--micro-batch 2]

Variants of our Mamba2 forward (training path only: no cache):
  default   dt onto B in B's dtype (bf16), SSD output + D x in bf16 (what the layer does)
  skip32    the D skip in fp32 (the gated norm reads an fp32 y), as the peer
  v32       dt onto x in fp32, then cast (B unscaled), as the peer
  peerlike  skip32 + v32
  torch     the layer as it is, every mixer and norm on the torch path (on a GPU: without the Triton kernels)
"""
import argparse
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from hybridlm.bench import loss_parity as lp, peer_ssd  # noqa: E402
from hybridlm.bench.peer_weights import mapped_peer_state  # noqa: E402
from hybridlm.model.layers import mamba2 as m2  # noqa: E402
from hybridlm.model.layers.conv import run_short_conv  # noqa: E402
from hybridlm.ops.backend import use_triton, use_triton_elementwise  # noqa: E402
from hybridlm.ops.chunked_recurrence import chunk_gated_recurrence  # noqa: E402
from hybridlm.ops.elementwise import gated_rms_norm  # noqa: E402

ORIGINAL_FORWARD = m2.Mamba2.forward


def variant_forward(skip32: bool, v32: bool):
    def forward(self, hidden, ctx=None):
        assert ctx is None, "the probe covers the training path only"
        Bsz, T, _ = hidden.shape
        triton = use_triton(self.backend, hidden)
        z, xbc, dt = self.in_proj(hidden).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = run_short_conv(self.conv1d, xbc, triton, None)
        x, b, c = xbc.split([self.d_xb, self.d_b, self.n_groups * self.d_state], dim=-1)
        x = self._repeat_heads(x, self.d_xb // self.head_dim, self.head_dim)
        c = self._repeat_heads(c, self.n_groups, self.d_state)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        g = -self.A_log.float().exp() * dt
        if v32:
            k = self._repeat_heads(b, self.d_b // self.d_state, self.d_state)
            v = (x.float() * dt[..., None]).to(x.dtype)
        else:
            k, v = self._dt_scaled_keys(b, dt), x
        if triton:
            y, _ = self._triton_ssd(c, k, v, g, None)
        else:
            y, _ = chunk_gated_recurrence(c, k, v, g, beta=None, scale=1.0, chunk_size=self.chunk_size)
        if skip32:
            y = y.float() + self.D.float().view(-1, 1) * x.float()
        else:
            y = torch.addcmul(y, x, self.D.to(x.dtype).view(-1, 1))
        y = gated_rms_norm(y.reshape(Bsz, T, self.d_inner), z, self.norm_weight, self.norm_eps,
                           activation="swish", norm_before_gate=False, group_size=self.d_inner // self.n_groups,
                           triton=triton and use_triton_elementwise(self.backend, y))
        return self.out_proj(y.to(hidden.dtype))
    return forward


VARIANTS = {"default": None, "skip32": (True, False), "v32": (False, True), "peerlike": (True, True), "torch": None}


def set_backend(model, backend: str) -> None:
    for m in model.modules():
        if hasattr(m, "backend"):
            m.backend = backend


def kind_of(name: str) -> str:
    for k in ("embed", "in_proj", "conv1d", "A_log", "dt_bias", ".D", "norm_weight", "out_proj", "norm"):
        if k in name:
            return k.strip(".")
    return name


def compare(a, b):
    """Relative difference ||a - b|| / ||b|| per parameter kind and in all, and the worst tensor cosine."""
    num, den = defaultdict(float), defaultdict(float)
    worst = 1.0
    for n in b:
        d = (a[n] - b[n]).pow(2).sum().item()
        r = b[n].pow(2).sum().item()
        num[kind_of(n)] += d
        den[kind_of(n)] += r
        num["all"] += d
        den["all"] += r
        worst = min(worst, F.cosine_similarity(a[n].flatten(), b[n].flatten(), dim=0).item())
    return {k: (num[k] / max(den[k], 1e-30)) ** 0.5 for k in num}, worst


def peer_grads_as_ours(ours, peer, grads):
    """The peer's gradients under our parameter names (the weight mapping applied to gradients)."""
    saved = {n: p.data for n, p in peer.named_parameters()}
    for n, p in peer.named_parameters():
        p.data = grads[n]
    try:
        mapped = mapped_peer_state(ours, peer, "hf", "mamba2")
    finally:
        for n, p in peer.named_parameters():
            p.data = saved[n]
    return {n: t.float() for n, t in mapped.items() if n in dict(ours.named_parameters())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--config", default="mamba2_300m")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--model-override", nargs="*", default=[])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    a = p.parse_args()
    args = lp.parse_args(["--family", "mamba2", "--out", "/tmp/probe_same_weights", "--peer", "hf", "--seeds", "0",
                          "--config", a.config, "--data", a.data, "--seq", str(a.seq),
                          "--micro-batch", str(a.micro_batch), "--model-override", *a.model_override])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from pathlib import Path
    data_dir = Path(a.data)
    config = lp.resolve_config(args, data_dir)
    peer_ssd.install(peer_ssd.fla_gla_op if device.type == "cuda" else peer_ssd.torch_gla_op)
    peer, _ = lp.build_peer("hf", "mamba2", config, 0, args)
    ours, _ = lp.ours_from_peer(config, 0, args)
    peer.to(device).train()
    ours.to(device).train()
    ids = next(lp.train_batches(data_dir, a.seq, a.micro_batch))["input_ids"].to(device)
    print(f"device {device}, batch {tuple(ids.shape)}, torch {torch.__version__}", flush=True)

    ref = {}
    for bf16 in (False, True):
        loss, g = peer_ssd.loss_and_grads(peer, ids, bf16)
        ref[bf16] = (loss, peer_grads_as_ours(ours, peer, g))
    kinds = ["all", "embed", "in_proj", "conv1d", "A_log", "dt_bias", "D", "norm_weight", "out_proj"]
    print("rel. gradient difference per kind: " + " ".join(kinds))
    peer32 = ref[False][1]
    gn = lambda g: sum(t.pow(2).sum() for t in g.values()).sqrt().item()  # noqa: E731
    def report(label, loss, g):
        rel, worst = compare(g, peer32)
        print(f"{label:<22} loss {loss:.5f} gnorm {gn(g):.4f}  vs peer fp32: " +
              " ".join(f"{rel.get(k, float('nan')):.4f}" for k in kinds) + f"  worst cos {worst:.4f}", flush=True)

    report("peer fp32", ref[False][0], peer32)
    report("peer bf16", ref[True][0], ref[True][1])
    for name in a.variants:
        m2.Mamba2.forward = ORIGINAL_FORWARD if VARIANTS[name] is None else variant_forward(*VARIANTS[name])
        set_backend(ours, "torch" if name == "torch" else "auto")
        for bf16 in ((False, True) if name in ("default", "torch") else (True,)):
            loss, g = peer_ssd.loss_and_grads(ours, ids, bf16)
            report(f"ours {name} {'bf16' if bf16 else 'fp32'}", loss, g)
    m2.Mamba2.forward = ORIGINAL_FORWARD
    set_backend(ours, "auto")


if __name__ == "__main__":
    main()
