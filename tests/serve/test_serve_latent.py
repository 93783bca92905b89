"""The MLA layers served from their latent (HYBRIDLM_VLLM_MLA_CACHE=latent, hybridlm/serve): what a CPU can check.
vLLM's latent path runs on its MLA backends (CUDA, fp16 / bf16; its CPU kernel takes only DeepSeek's 512 + 64), so
here: the plugin's convertor makes vLLM read an export as latent attention of the latent's size, the per-head
default is untouched, a wrong setting and the CPU are refused with one line, and vLLM's own split of the served
kv_b (its ``split_kv_b_proj``, what its MLA backends absorb into the query and the output) attends over the latent
exactly as the toolkit's MLA layer does. Tokens on CUDA: docs/generation.md, "Serving with vLLM"."""
import json

import pytest
import torch

vllm = pytest.importorskip("vllm")

from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj  # noqa: E402
from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS  # noqa: E402

from hybridlm.config.errors import ConfigError  # noqa: E402
from hybridlm.model import HybridForCausalLM  # noqa: E402
from hybridlm.serve.mapping import MLA_CACHE_ENV, latent_size, mla_cache_mode, served_weights  # noqa: E402
from hybridlm.serve.plugin import ServedHybridArchConvertor, register  # noqa: E402
from tests.serve.export import build_export  # noqa: E402
from tests.serve.test_serve_vllm import NEW, RESULT, _run_vllm  # noqa: E402


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return build_export(tmp_path_factory.mktemp("latent") / "final")


def _arch(export):
    register()
    config = AutoConfig.from_pretrained(export)  # the served config, as vLLM reads it
    convertor = MODEL_ARCH_CONFIG_CONVERTORS[config.model_type]
    assert convertor is ServedHybridArchConvertor
    return config, convertor(config, config.get_text_config()).convert()


def test_latent_mode_makes_vllm_read_the_mla_layers_as_latent_attention(export, monkeypatch):
    monkeypatch.setenv(MLA_CACHE_ENV, "latent")
    config, arch = _arch(export)
    a = config.mixer_args("mla")
    assert arch.is_deepseek_mla
    assert arch.head_size == latent_size(config) == a.kv_lora_rank + a.qk_rope_head_dim == 40


def test_the_default_keeps_per_head_attention(export, monkeypatch):
    monkeypatch.delenv(MLA_CACHE_ENV, raising=False)
    config, arch = _arch(export)
    assert not arch.is_deepseek_mla
    assert arch.head_size == config.head_dim == 32  # 16 + 8 per head, padded to a size vLLM's kernels take


def test_an_unknown_setting_is_one_error_naming_it(monkeypatch):
    monkeypatch.setenv(MLA_CACHE_ENV, "compressed")
    with pytest.raises(ConfigError, match=f"^{MLA_CACHE_ENV}='compressed': expected one of heads, latent$"):
        mla_cache_mode()


def test_latent_mode_on_cpu_is_refused_with_one_line(export):
    proc = _run_vllm(export, [[[1, 2, 3]]], dtype="bfloat16", env={MLA_CACHE_ENV: "latent"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # raised in vLLM's config validation, which reports a ValueError as pydantic's "Value error, <message>"
    assert (f"{MLA_CACHE_ENV}=latent: vLLM's CPU MLA kernel takes a 576-value latent (512 + 64) only; this export's "
            f"is 40: serve it with the per-head cache ({MLA_CACHE_ENV}=heads) on CPU") in out, out[-3000:]


class _Linear(torch.nn.Module):
    """What split_kv_b_proj reads of a vLLM linear: its weight and an unquantized method."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.quant_method = torch.nn.Parameter(weight), None


def test_vllm_absorbs_the_served_kv_b_as_the_toolkit_attends(export):
    """Attention over the cached latent with vLLM's W_UK / W_UV from the served kv_b equals the toolkit's MLA layer
    (its per-head keys and values decompressed by kv_b) on the same input: the weight layout the latent path needs."""
    model = HybridForCausalLM.from_pretrained(export, runtime={"backend": "torch"}).eval().double()
    layer = model.model.layers[0].mixer
    served = dict(served_weights(model.config, model.state_dict().items()))
    kv_b = served["model.layers.0.mixer.kv_b_proj.weight"]
    H, P, V, L = layer.num_heads, layer.nope, layer.v_dim, layer.kv_lora_rank
    w_uk, w_uv = split_kv_b_proj(_Linear(kv_b), torch.float64, L, H, P, V)  # [L, H, P], [L, H, V]
    x = torch.randn(1, 11, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q_nope, q_rope, latent, k_rope = layer._project(x, torch.arange(11))
        expected = layer._attend_expanded(q_nope, q_rope, latent, k_rope, None)[0]  # [T, H, V]
        q_latent = torch.einsum("thp,lhp->thl", q_nope[0], w_uk)  # the query in the latent space
        scores = (torch.einsum("thl,sl->hts", q_latent, latent[0])
                  + torch.einsum("thr,sr->hts", q_rope[0], k_rope[0])) * layer.scale
        scores = scores.masked_fill(torch.ones(11, 11, dtype=torch.bool).triu(1), float("-inf"))
        o_latent = torch.einsum("hts,sl->thl", scores.softmax(-1), latent[0])
        absorbed = torch.einsum("thl,lhv->thv", o_latent, w_uv)
    assert absorbed.shape == expected.shape == (11, H, V)
    torch.testing.assert_close(absorbed, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's MLA backends need CUDA")
def test_latent_greedy_tokens_equal_generate_on_cuda(export):
    """On CUDA in bf16: vLLM serving the MLA layers from the latent gives generate()'s greedy tokens."""
    tok = AutoTokenizer.from_pretrained(export)
    prompts = [tok(t)["input_ids"] for t in ("Once upon a time", "It is a truth universally acknowledged, that")]
    proc = _run_vllm(export, [prompts], dtype="bfloat16", env={MLA_CACHE_ENV: "latent"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    served = json.loads(line[len(RESULT):])["tokens"][0]
    model = HybridForCausalLM.from_pretrained(export, torch_dtype=torch.bfloat16).cuda().eval()
    cfg = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for ids, tokens in zip(prompts, served):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device="cuda"), generation_config=cfg)
        assert tokens == out[0, len(ids):].tolist()
