"""Quiet by default: saving and loading a model prints no third-party bar or warning our user cannot act on
(transformers' weight bars, DeepSpeed's accelerator warning), and lm_eval's chat-template advice is dropped."""
import logging
import subprocess
import sys

from conftest import REPO, subprocess_env
from hybridlm.eval.harness import _no_chat_template_advice

SAVE_AND_LOAD = """
import tempfile
import hybridlm.model
from transformers import AutoModelForCausalLM
from hybridlm.model import HybridConfig, HybridForCausalLM
cfg = HybridConfig(vocab_size=64, hidden_size=32, intermediate_size=64, hybrid_override_pattern="*-M-",
                   mla={"num_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8},
                   gdn={"num_heads": 2, "head_dim": 16})
with tempfile.TemporaryDirectory() as d:
    HybridForCausalLM(cfg).save_pretrained(d)
    AutoModelForCausalLM.from_pretrained(d)
print("done")
"""


def test_save_and_load_print_nothing_else():
    env = subprocess_env()
    env.pop("DS_ACCELERATOR")  # as a user's shell: the package must name DeepSpeed's accelerator itself
    res = subprocess.run([sys.executable, "-c", SAVE_AND_LOAD], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "done"
    for noise in ("Loading weights", "Writing model shards", "Setting accelerator to CPU"):
        assert noise not in res.stderr, res.stderr[-2000:]


def test_lm_evals_chat_template_advice_is_dropped_and_nothing_else():
    def record(msg):
        return logging.LogRecord("lm_eval.evaluator", logging.WARNING, "", 0, msg, None, None)
    assert not _no_chat_template_advice(record("pretrained=x appears to be an instruct or chat variant but chat "
                                               "template is not applied."))
    assert _no_chat_template_advice(record("Task austen_cloze: 500 documents"))
