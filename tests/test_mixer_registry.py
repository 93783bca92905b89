"""The mixer registry (hybridlm/model/registry.py): a mixer defined in this file alone (its settings, module,
costs, init, upcycling from attention and registry entry, as a built-in mixer's file under hybridlm/model/layers/
holds them), registered with ``register_mixer``, goes through the pattern, the config, the model, training,
save / load, the generation cache, the KV report, ``upcycle plan`` and ``upcycle init`` (through what its entry
gives) like a built-in one, is refused by the vLLM checks (its entry names no served layer), and leaves nothing
behind once unregistered. docs/design.md, "A mixer", is the recipe this file follows."""
import json
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_config
from hybridlm.config.errors import ConfigError
from hybridlm.kv_report import format_kv_report, kv_layers, kv_report
from hybridlm.model import HybridConfig, HybridForCausalLM
from hybridlm.model.cache import HybridCache, LatentCacheLayer, RecurrentCacheLayer
from hybridlm.model.layers import SUBLAYERS
from hybridlm.model.layers.conv import recurrent_context
from hybridlm.model.registry import (MixerCosts, cache_of, costs_of, kind_of_symbol, linear_kinds, mixer_spec,
                                     register_mixer, symbol_of, unregister_mixer)
from hybridlm.model.runtime import RuntimeSettings
from upcycle.init_copy import copy_into, repeat_kv_rows
from upcycle.init_linear import FromAttention
from upcycle.teacher_attention import attention_shapes, attention_weights

DECAY_BIAS = 2.0  # sigmoid(2) ~ 0.88: the recurrence starts out averaging over ~8 tokens


@dataclass
class GatedAverageArgs:
    width: Optional[int] = None  # default hidden_size

    def finalize(self, hidden: int, where: str) -> None:
        self.width = self.width or hidden
        if not isinstance(self.width, int) or self.width <= 0:
            raise ConfigError(f"{where}.width: must be a positive integer, got {self.width!r}")


class GatedAverage(nn.Module):
    """A gated moving average: ``h_t = a_t h_{t-1} + (1 - a_t) v_t`` per channel, ``a_t = sigmoid(W_a x_t + b)``
    (``b``: ``decay_bias``, set by the registry's ``init``), output ``W_o (h_t * silu(W_g x_t))``; the cache holds
    ``h`` (a recurrent state of ``width`` floats)."""

    def __init__(self, args: GatedAverageArgs, hidden_size: int, layer_idx: int = 0,
                 runtime: Optional[RuntimeSettings] = None):
        super().__init__()  # element-wise work in fp32 only: nothing here reads the runtime settings
        self.layer_idx, self.width = layer_idx, args.width
        self.in_proj = nn.Linear(hidden_size, 3 * args.width, bias=False)
        self.decay_bias = nn.Parameter(torch.zeros(args.width))
        self.out_proj = nn.Linear(args.width, hidden_size, bias=False)

    def cache_shapes(self) -> dict:
        return {"state": (self.width,), "conv": {}}

    def forward(self, hidden: torch.Tensor, ctx=None) -> torch.Tensor:
        cache, hidden = recurrent_context(ctx, self.layer_idx, hidden)
        B, T, _ = hidden.shape
        a, v, g = self.in_proj(hidden).float().chunk(3, dim=-1)
        a = torch.sigmoid(a + self.decay_bias.float())
        u = (1 - a) * v
        if ctx is not None and ctx.key_mask is not None:  # padding leaves the state as it is
            keep = ctx.key_mask[:, -T:].unsqueeze(-1)
            a, u = torch.where(keep, a, torch.ones_like(a)), torch.where(keep, u, torch.zeros_like(u))
        h = hidden.new_zeros(B, self.width, dtype=torch.float32)
        if cache is not None and cache.state is not None:
            h = cache.state
        out = []
        for t in range(T):
            h = a[:, t] * h + u[:, t]
            out.append(h)
        if cache is not None:
            cache.advance(h, T)
        y = torch.stack(out, dim=1) * F.silu(g)
        return self.out_proj(y.to(hidden.dtype))


def init_gated_average(module: GatedAverage, config) -> None:
    with torch.no_grad():
        module.decay_bias.fill_(DECAY_BIAS)


@torch.no_grad()
def gated_average_from_attention(mixer: GatedAverage, attn) -> None:
    """``upcycle init``: the attention's values (each kv head repeated for its query heads) as v, its output
    projection as out_proj."""
    s, w = attention_shapes(attn), attention_weights(attn)
    _, v, _ = mixer.in_proj.weight.split(mixer.width, dim=0)
    copy_into(v, repeat_kv_rows(w["v"], s["n_kv"], s["n_h"]))
    copy_into(mixer.out_proj.weight, w["o"])


# one value channel per query-head channel of the teacher
GATED_AVERAGE_FROM_ATTENTION = FromAttention(student_args=lambda s: {"width": s["n_h"] * s["d_h"]},
                                             init=gated_average_from_attention)


# what the planners know of it: element-wise work only beyond its weights (a_t h, (1 - a_t) v, their sum, the gate
# product), a state of ``width`` floats, and the backward keeps in_proj's output, the fp32 states and y
GATED_AVERAGE_COSTS = MixerCosts(flops=lambda a, seq_len: 4.0 * a.width, state_per_sequence=lambda a: a.width,
                                 activations=lambda a: 3 * a.width + 2 * a.width + a.width)


@pytest.fixture
def gated_average():
    spec = register_mixer("gatedavg", symbol="X", args=GatedAverageArgs, module=GatedAverage, cache="recurrent",
                          init=init_gated_average, costs=GATED_AVERAGE_COSTS,
                          from_attention=GATED_AVERAGE_FROM_ATTENTION)
    try:
        yield spec
    finally:
        unregister_mixer("gatedavg")


def config(pattern="*-X-", **overrides):
    return tiny_config(pattern, vocab_size=64, hidden_size=32, intermediate_size=64,
                       mla=dict(num_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                v_head_dim=16, rope_theta=10000.0),
                       gdn=dict(num_heads=2), kda=dict(num_heads=2),
                       mamba2=dict(d_state=8, head_dim=16, n_groups=2, expand=2), **overrides)


def test_builtin_entries():
    assert {k: kind_of_symbol(s) for k, s in (("mla", "*"), ("gdn", "G"), ("kda", "K"), ("mamba2", "S"))} == \
        {"mla": "mla", "gdn": "gdn", "kda": "kda", "mamba2": "mamba2"}
    assert symbol_of("mla") == "*" and symbol_of("mlp") == "-"
    assert sorted(linear_kinds()) == ["gdn", "kda", "mamba2"]
    assert cache_of("mla") == "latent" and cache_of("gdn") == cache_of("mamba2") == "recurrent" and cache_of("mlp") is None
    assert list(SUBLAYERS) == ["mla", "gdn", "kda", "mamba2", "mlp"]
    assert [mixer_spec(k).name for k in ("mla", "gdn", "kda", "mamba2")] == ["MLA", "GDN", "KDA", "Mamba2"]
    assert all(costs_of(k).activations is not None for k in ("mla", "gdn", "kda", "mamba2"))


def test_builtin_entries_name_their_upcycling_and_serving_twins():
    """Each built-in entry names its ``upcycle init`` from attention and its vLLM layer and weight mapping; every
    name resolves (the served layers by reading hybridlm/serve/model.py: vLLM is not installed here)."""
    import ast

    from conftest import REPO
    from hybridlm.model.registry import load_object
    from hybridlm.serve.mapping import served_kinds
    from upcycle.init_linear import from_attention, upcycling_kinds

    assert upcycling_kinds() == ["gdn", "kda", "mamba2"]
    assert all(isinstance(from_attention(k), FromAttention) for k in upcycling_kinds())
    assert from_attention("mla") is None  # the attention student: SVD-initialised by the route, not a linear mixer
    assert served_kinds() == ["mla", "mamba2", "mlp"]
    assert [mixer_spec(k).serve_layer for k in ("mla", "gdn", "kda", "mamba2")] == \
        ["hybridlm.serve.model:served_mla", None, None, "hybridlm.serve.model:ServedMamba2"]
    served = {node.name for node in ast.parse((REPO / "hybridlm/serve/model.py").read_text()).body
              if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    assert {"served_mla", "ServedMamba2"} <= served
    assert callable(load_object(mixer_spec("mamba2").serve_weights)) and mixer_spec("mla").serve_weights is None


def test_the_old_cache_name_still_registers():
    with pytest.warns(FutureWarning, match="cache='kv' is now cache='latent'"):
        register_mixer("oldname", symbol="Y", args=GatedAverageArgs, module=GatedAverage, cache="kv")
    try:
        assert cache_of("oldname") == "latent"
    finally:
        unregister_mixer("oldname")


def test_registration_is_checked(gated_average):
    with pytest.raises(ValueError, match="already registered"):
        register_mixer("gatedavg", symbol="Y", args=GatedAverageArgs, module=GatedAverage, cache=None)
    with pytest.raises(ValueError, match="already stands for 'gdn'"):
        register_mixer("other", symbol="G", args=GatedAverageArgs, module=GatedAverage, cache=None)
    for kind in ("mlp", "hidden_size", "Gla"):
        with pytest.raises(ValueError, match="lower-case identifier"):
            register_mixer(kind, symbol="Y", args=GatedAverageArgs, module=GatedAverage, cache=None)
    for symbol in ("M", "-", "YY"):
        with pytest.raises(ValueError, match="one character"):
            register_mixer("other", symbol=symbol, args=GatedAverageArgs, module=GatedAverage, cache=None)
    with pytest.raises(ValueError, match="cache"):
        register_mixer("other", symbol="Y", args=GatedAverageArgs, module=GatedAverage, cache="paged")
    with pytest.raises(TypeError, match="dataclass"):
        register_mixer("other", symbol="Y", args=dict, module=GatedAverage, cache=None)
    with pytest.raises(TypeError, match="MixerCosts"):
        register_mixer("other", symbol="Y", args=GatedAverageArgs, module=GatedAverage, cache=None, costs={})
    class BuiltFromTheConfig(nn.Module):  # the contract before layers took their own settings
        def __init__(self, config, layer_idx: int = 0):
            super().__init__()
    with pytest.raises(TypeError, match=r"module of 'other' must be built as module\(args, hidden_size, layer_idx=0, "
                                        r"runtime=None\) .*; BuiltFromTheConfig takes \(config, layer_idx: int = 0\)"):
        register_mixer("other", symbol="Y", args=GatedAverageArgs, module=BuiltFromTheConfig, cache=None)
    with pytest.raises(TypeError, match=r"from_attention of 'other' must have student_args\(shapes\) and init"):
        register_mixer("other", symbol="Y", args=GatedAverageArgs, module=GatedAverage, cache=None,
                       from_attention=gated_average_from_attention)
    with pytest.raises(TypeError, match="serve_layer of 'other' must be a 'package.module:name' string"):
        register_mixer("other", symbol="Y", args=GatedAverageArgs, module=GatedAverage, cache=None,
                       serve_layer=GatedAverage)


def test_decorator_form():
    @register_mixer("decorated", symbol="Z", args=GatedAverageArgs, cache=None)
    class Decorated(GatedAverage):
        pass
    try:
        assert mixer_spec("decorated").module is Decorated and kind_of_symbol("Z") == "decorated"
    finally:
        unregister_mixer("decorated")
    assert kind_of_symbol("Z") is None


def test_pattern_config_and_cache_read_the_registry(gated_average):
    cfg = config("*-X-M-", mixer="gatedavg", gatedavg=dict(width=24))
    assert cfg.layer_plan == ["mla", "mlp", "gatedavg", "mlp", "gatedavg", "mlp"]
    assert cfg.mixer_args("gatedavg").width == 24 and cfg.to_dict()["gatedavg"] == {"width": 24}
    assert HybridConfig(**cfg.to_dict()).to_dict() == cfg.to_dict()
    with pytest.raises(ConfigError, match=r"^gatedavg\.width: must be a positive integer"):
        config(gatedavg=dict(width=-1))
    # a stack that does not use the new mixer saves exactly what it saved before it was registered
    assert "gatedavg" not in config("*-G-").to_dict()
    cache = HybridCache(cfg)
    assert [type(l) for l in cache.layers[::2]] == [LatentCacheLayer, RecurrentCacheLayer, RecurrentCacheLayer]
    static = HybridCache(cfg, max_length=8, batch_size=2)
    assert static.layers[2].state.shape == (2, 24)
    assert kv_layers(["mla", "gatedavg", "mla"]) == [0, 2]

    # the KV report: its cache per token (0) and its state (width values) from its registry costs
    teacher = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    rep = kv_report(teacher, [0, 2], 8, 8, layer_kinds=["mla", "gatedavg", "mla"])
    assert [r["kind"] for r in rep["per_layer"]] == ["mla", "gatedavg", "mla"]
    assert [r["hybrid_values"] for r in rep["per_layer"]] == [16, 0, 16] and rep["hybrid_values_per_token"] == 2 * 16
    assert [r["state_values"] for r in rep["per_layer"]] == [0, 64, 0] and rep["hybrid_state_values"] == 64
    text = format_kv_report(rep)
    assert "KV cache: 2 MLA + 1 gatedavg of 3 layers (values per token and layer: MLA 16, gatedavg 0;" in text
    assert "fixed-size state per sequence: gatedavg 1 x 64 = 64 values" in text
    rep = kv_report(teacher, [0], 8, 8, linear_mixer="gatedavg", mixer_args={"gatedavg": cfg.mixer_args("gatedavg")})
    assert rep["mixers"][1] == dict(kind="gatedavg", title="gatedavg", layers=2, values_per_token=0, state_values=24)


def test_upcycle_plan_reads_its_costs(gated_average, tmp_path, capsys):
    """``upcycle plan`` with the test mixer as the linear student: its own ILD stage, FLOPs, cache, state and
    activation figures, from its registry entry."""
    from types import SimpleNamespace

    import yaml
    from transformers import LlamaConfig

    from upcycle.plan import BF16, MixerPlan, activation_bytes, cmd_plan, plan_route, student_kinds
    from upcycle.student import student_config

    teacher = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=True)
    optim = {"micro_batch_size": 2, "global_batch_size": 16, "max_steps": 10, "lr": 1e-4}
    route = {"init": {"q_lora_rank": 48, "kv_lora_rank": 24, "qk_rope_head_dim": 8, "linear_mixer": "gatedavg"},
             "ild": {"data": {"path": "ild_data", "seq_len": 32}, "optim": dict(optim)},
             "smart": {"n_mla": 2, "batches": 2, "batch_size": 2},
             "kd": {"data": {"format": "packed", "path": "ild_data", "seq_len": 32}, "optim": dict(optim)},
             "dpo": {"data": {"path": "pairs.json", "max_length": 32, "max_prompt_length": 16}, "optim": dict(optim)}}
    plan = plan_route(route, teacher, 4)
    stages = {p.name: p for p in plan.stages}
    assert list(stages) == ["init", "ild_mla", "ild_gatedavg", "smart", "kd", "dpo"]
    assert plan.mixers[1] == MixerPlan("gatedavg", 2, 32, 4.0 * 64, 0, 64, 6 * 64)
    kinds = ["gatedavg"] * 4
    student = student_config(teacher, kinds, q_lora_rank=48, kv_lora_rank=24, qk_rope_head_dim=8)
    assert stages["ild_gatedavg"].bytes["activations"] == activation_bytes(student, kinds, 2 * 32, False) \
        == int(2 * 32 * BF16 * 4 * ((2 * 64 + 6 * 64) + (2 * 64 + 3 * 96)))
    hybrid = student_config(teacher, student_kinds(4, 2, "gatedavg"), q_lora_rank=48, kv_lora_rank=24,
                            qk_rope_head_dim=8)
    # its FLOPs enter the stage's time: the hybrid's forward per token beyond 2 per parameter
    mla = costs_of("mla").flops(hybrid.mixer_args("mla"), 32)
    assert plan.mixers[0].flops_per_token == mla and plan.mixers[0].cache_per_token == 24 + 8

    (tmp_path / "route.yaml").write_text(yaml.safe_dump({**route, "init": {**route["init"], "linear_mixer": "mamba2"}}))
    teacher.to_json_file(tmp_path / "teacher.json")
    args = SimpleNamespace(config=tmp_path / "route.yaml", teacher=str(tmp_path / "teacher.json"), gpus=4,
                           overrides=["init.linear_mixer=gatedavg"], peak_tflops=989.0, mfu=0.3, gpu_mem_gib=80.0)
    result = cmd_plan(args)
    out = capsys.readouterr().out
    assert "| ild_gatedavg |" in out
    row = next(line for line in out.splitlines() if line.startswith("| gatedavg "))
    assert [c.strip() for c in row.strip("|").split("|")] == ["gatedavg", "2", "256", "0", "64", "384"]
    assert result["mixers"][1]["kind"] == "gatedavg" and result["mixers"][1]["flops_per_token"] == 256.0


def test_upcycle_init_builds_it_from_attention_and_vllm_refuses_it(gated_average):
    """``upcycle init`` finds the mixer's student settings and weight copy through its entry (``from_attention``):
    ``--linear-mixer gatedavg`` is offered, the student's config carries its settings, and each layer's v and
    out_proj are the teacher attention's. Its entry names no served layer, so serving refuses the stack."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridlm.serve.mapping import check_servable
    from upcycle.cli import build_parser
    from upcycle.init_from_teacher import init_student_from_teacher
    from upcycle.student import student_config

    assert build_parser().parse_args(["init", "--teacher", "t", "--out", "o", "--linear-mixer", "gatedavg"]) \
        .linear_mixer == "gatedavg"
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           vocab_size=64, tie_word_embeddings=True)).eval()
    kinds = ["mla", "gatedavg"]
    cfg = student_config(teacher.config, kinds, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8)
    assert cfg.mixer_args("gatedavg").width == 4 * 16 and cfg.to_dict()["gatedavg"] == {"width": 64}
    student = HybridForCausalLM(cfg)
    init_student_from_teacher(student, teacher, kinds)
    mixer, attn = student.model.layers[2].mixer, teacher.model.layers[1].self_attn
    v = mixer.in_proj.weight[64:128]
    assert torch.equal(v[:16], attn.v_proj.weight[:16]) and torch.equal(v[16:32], attn.v_proj.weight[:16])
    assert torch.equal(v[32:48], attn.v_proj.weight[16:]) and torch.equal(mixer.out_proj.weight, attn.o_proj.weight)
    from upcycle.calibrate import fit_output_scale
    with pytest.raises(ConfigError, match=r"init.calib_tokens: a GatedAverage mixer has no output norm .* "
                                          r"set init.calib_tokens: 0"):
        fit_output_scale(mixer, torch.randn(1, 4, 32), torch.randn(1, 4, 32))
    with pytest.raises(ConfigError, match=r"layer 2 is gatedavg \('X'\); serving with vLLM runs MLA \('\*'\), Mamba2 "
                                          r"\('S', or 'M' with mixer: mamba2\) and MLP \('-'\) layers only"):
        check_servable(cfg)


def test_train_save_load_generate(gated_average, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = HybridForCausalLM(config("X-*-X-"))
    assert torch.all(model.model.layers[0].mixer.decay_bias == DECAY_BIAS)  # the registry's init ran
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 64, (4, 24))
    losses = []
    for _ in range(12):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    model.eval()
    prompt = ids[:2, :6]
    with torch.no_grad():  # the cached forward agrees with the full recompute
        full = model(ids[:2, :10]).logits
        out = model(prompt, use_cache=True)
        step = model(ids[:2, 6:10], cache=out.cache).logits
    torch.testing.assert_close(step, full[:, 6:10], atol=1e-5, rtol=1e-5)
    before = model.generate(prompt, max_new_tokens=5, do_sample=False)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["hybrid_override_pattern"] == "X-*-X-" and saved["gatedavg"] == {"width": 32}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded.model.layers[0].mixer, GatedAverage)
    after = loaded.generate(prompt, max_new_tokens=5, do_sample=False)
    assert before.shape == (2, 11) and torch.equal(before, after)


def test_unregistered_mixer_is_unknown(gated_average):
    unregister_mixer("gatedavg")
    try:
        with pytest.raises(ConfigError, match="unknown symbol 'X'"):
            config("*-X-")
        with pytest.raises(ConfigError, match="unknown mixer 'gatedavg'"):
            config("*-M-", mixer="gatedavg")
        with pytest.raises(ConfigError, match="unknown key"):
            HybridConfig.from_user_dict(dict(hybrid_override_pattern="*-G-", gatedavg={}))
    finally:  # the fixture unregisters it again
        register_mixer("gatedavg", symbol="X", args=GatedAverageArgs, module=GatedAverage, cache="recurrent")


def test_the_recipe_in_design_md_names_the_contract_as_it_is():
    """docs/design.md, "A mixer": the keywords it gives ``register_mixer`` are the function's, the constructor it
    states is every built-in mixer's (and this file's), and every file it names exists."""
    import inspect
    import re

    from conftest import REPO
    from hybridlm.model.registry import mixers

    text = (REPO / "docs/design.md").read_text(encoding="utf-8")
    section = text[text.index("## A mixer: one file, one registry entry"):]
    section = section[:section.index("\n## ", 1)]
    call = re.search(r"`register_mixer\(kind, ([^`]*)\)`", section.replace("\n", " ")).group(1)
    stated = set(re.findall(r"(\w+)=", call))
    params = inspect.signature(register_mixer).parameters
    assert stated == {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert "`Module(args, hidden_size, layer_idx=0, runtime=None)`" in section
    for module in [spec.module for spec in mixers()] + [GatedAverage]:
        got = [(n, p.default) for n, p in inspect.signature(module.__init__).parameters.items()][1:]
        assert got == [("args", inspect.Parameter.empty), ("hidden_size", inspect.Parameter.empty),
                       ("layer_idx", 0), ("runtime", None)], module.__name__
    named = set(re.findall(r"`((?:hybridlm|upcycle|tests|benchmarks)/[\w/]+\.py)`", section))
    assert named and not [p for p in named if not (REPO / p).is_file() and "<name>" not in p]
