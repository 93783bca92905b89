"""Independent per-token reference implementations of every sublayer, written from the equations.

They share no code with ``hybridlm``: explicit loops over time, float64, used only by tests.
"""
import math

import torch
import torch.nn.functional as F


def _d(t):
    return t.double()


def causal_conv(x, weight, bias=None):
    """x [B,T,D], weight [D,W]: y_t = sum_w weight[:, w] * x_{t-W+1+w}, then SiLU."""
    B, T, D = x.shape
    W = weight.shape[1]
    ys = []
    for t in range(T):
        acc = torch.zeros(B, D, dtype=x.dtype)
        for w in range(W):
            s = t - (W - 1) + w
            if s >= 0:
                acc = acc + weight[:, w] * x[:, s]
        if bias is not None:
            acc = acc + bias
        ys.append(acc)
    y = torch.stack(ys, 1)
    return y * torch.sigmoid(y)


def rmsnorm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def delta_rule_layer(m, x, per_channel_gate, out_act):
    """Gated DeltaNet (per_channel_gate False) or KDA (True) forward, per token."""
    x = _d(x)
    p = {n: _d(t) for n, t in m.named_parameters()}
    B, T, _ = x.shape
    H, K, HV, V = m.num_heads, m.head_k_dim, m.num_v_heads, m.head_v_dim

    def lin(name, inp):
        return inp @ p[name].t() + (p[name.replace("weight", "bias")] if name.replace("weight", "bias") in p else 0)

    q = causal_conv(lin("q_proj.weight", x), p["q_conv1d.weight"]).view(B, T, H, K)
    k = causal_conv(lin("k_proj.weight", x), p["k_conv1d.weight"]).view(B, T, H, K)
    v = causal_conv(lin("v_proj.weight", x), p["v_conv1d.weight"]).view(B, T, HV, V)
    if per_channel_gate:
        a = lin("f_proj.1.weight", lin("f_proj.0.weight", x)).view(B, T, HV, K)
        gate = lin("g_proj.1.weight", lin("g_proj.0.weight", x))
        dt_bias = p["dt_bias"].view(HV, K)
        A = torch.exp(p["A_log"]).view(HV, 1)
    else:
        a = lin("a_proj.weight", x).view(B, T, HV, 1)
        gate = lin("g_proj.weight", x)
        dt_bias = p["dt_bias"].view(HV, 1)
        A = torch.exp(p["A_log"]).view(HV, 1)
    gate = gate + p.get("g_bias", 0)                           # gate_bias / beta_bias: added to the projections
    decay = torch.exp(-A * F.softplus(a + dt_bias))           # [B,T,HV,K or 1]
    beta = torch.sigmoid(lin("b_proj.weight", x) + p.get("b_bias", 0))  # [B,T,HV]
    S = torch.zeros(B, HV, K, V, dtype=torch.float64)
    outs = []
    for t in range(T):
        for hv in range(HV):
            h = hv // (HV // H)  # grouped value heads share q/k head h
            qt = q[:, t, h] / torch.sqrt((q[:, t, h] ** 2).sum(-1, keepdim=True) + 1e-6)
            kt = k[:, t, h] / torch.sqrt((k[:, t, h] ** 2).sum(-1, keepdim=True) + 1e-6)
            Sh = S[:, hv] * decay[:, t, hv].unsqueeze(-1)
            pred = torch.einsum("bk,bkv->bv", kt, Sh)
            Sh = Sh + beta[:, t, hv, None, None] * kt.unsqueeze(-1) * (v[:, t, hv] - pred).unsqueeze(-2)
            S = S.clone()
            S[:, hv] = Sh
            outs.append(torch.einsum("bk,bkv->bv", qt * K ** -0.5, Sh))
    o = torch.stack(outs, 1).view(B, T, HV, V)
    g = gate.view(B, T, HV, V)
    act = torch.sigmoid(g) if out_act == "sigmoid" else g * torch.sigmoid(g)
    o = rmsnorm(o, p["o_norm_weight"], m.norm_eps) * act
    return o.reshape(B, T, HV * V) @ p["o_proj.weight"].t()


def mamba2_layer(m, x):
    x = _d(x)
    p = {n: _d(t) for n, t in m.named_parameters()}
    B, T, _ = x.shape
    H, P, N, G = m.num_heads, m.head_dim, m.d_state, m.n_groups
    zxbcdt = x @ p["in_proj.weight"].t()
    z, xbc, dt = zxbcdt.split([m.d_inner, m.conv_dim, H], -1)
    xbc = causal_conv(xbc, p["conv1d.weight"], p.get("conv1d.bias"))
    xs, Bs, Cs = xbc.split([m.d_xb, m.d_b, G * N], -1)
    dt = F.softplus(dt + p["dt_bias"])
    A = -torch.exp(p["A_log"])
    h = torch.zeros(B, H, P, N, dtype=torch.float64)
    ys = []
    x_heads_per = m.d_xb // P
    b_groups = m.d_b // N
    for t in range(T):
        yt = []
        for hh in range(H):
            xh = xs[:, t].view(B, x_heads_per, P)[:, hh // (H // x_heads_per)]
            bh = Bs[:, t].view(B, b_groups, N)[:, hh // (H // b_groups)]
            ch = Cs[:, t].view(B, G, N)[:, hh // (H // G)]
            hnew = torch.exp(dt[:, t, hh] * A[hh])[:, None, None] * h[:, hh] \
                + dt[:, t, hh][:, None, None] * xh.unsqueeze(-1) * bh.unsqueeze(-2)
            h = h.clone()
            h[:, hh] = hnew
            yt.append((hnew * ch.unsqueeze(1)).sum(-1) + p["D"][hh] * xh)
        ys.append(torch.stack(yt, 1).reshape(B, H * P))
    y = torch.stack(ys, 1)
    y = y * (z * torch.sigmoid(z))
    gs = m.d_inner // G
    yg = y.view(B, T, G, gs)
    y = (yg / torch.sqrt((yg * yg).mean(-1, keepdim=True) + m.norm_eps)).view(B, T, -1) * p["norm_weight"]
    return y @ p["out_proj.weight"].t()


def mla_layer(m, x):
    """Softmax attention written per query position; RoPE via complex rotation of (i, i + d/2) pairs."""
    x = _d(x)
    p = {n: _d(t) for n, t in m.named_parameters()}
    B, T, _ = x.shape
    H, dn, dr, dv = m.num_heads, m.nope, m.rope, m.v_dim
    eps = 1e-6
    if m.q_lora_rank:
        cq = x @ p["q_a_proj.weight"].t()
        if "q_a_norm.weight" in p:
            cq = rmsnorm(cq, p["q_a_norm.weight"], eps)
        q = cq @ p["q_b_proj.weight"].t()
    else:
        q = x @ p["q_proj.weight"].t()
    q = q.view(B, T, H, dn + dr)
    ckv = x @ p["kv_a_proj.weight"].t()
    c, kr = ckv[..., :m.kv_lora_rank], ckv[..., m.kv_lora_rank:]
    if "kv_a_norm.weight" in p:
        c = rmsnorm(c, p["kv_a_norm.weight"], eps)
    kv = (c @ p["kv_b_proj.weight"].t()).view(B, T, H, dn + dv)

    def rot(vec, pos):
        half = dr // 2
        freq = torch.tensor([m.rope_theta ** (-2 * i / dr) for i in range(half)], dtype=torch.float64)
        z = torch.complex(vec[..., :half], vec[..., half:]) * torch.polar(torch.ones(half, dtype=torch.float64), pos * freq)
        return torch.cat([z.real, z.imag], -1)

    outs = torch.zeros(B, T, H, dv, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            qt = torch.cat([q[:, t, h, :dn], rot(q[:, t, h, dn:], t)], -1)
            scores = []
            for j in range(t + 1):
                kj = torch.cat([kv[:, j, h, :dn], rot(kr[:, j], j)], -1)
                scores.append((qt * kj).sum(-1) / math.sqrt(dn + dr))
            w = torch.softmax(torch.stack(scores, -1), -1)
            outs[:, t, h] = sum(w[:, j, None] * kv[:, j, h, dn:] for j in range(t + 1))
    return outs.reshape(B, T, H * dv) @ p["o_proj.weight"].t()
