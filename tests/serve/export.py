"""A tiny MLA + Mamba2 export as the upcycling route writes one: its config from ``upcycle.student`` for a small
Llama teacher (full-rank q through q_a / q_b, no latent norms, the teacher's llama3-scaled RoPE frequencies as
``rope_inv_freq``; MambaInLlama Mamba2 with x / B shared across heads, a gate bias and a conv bias), random
weights, and the toolkit's cached Llama-3.2 tokenizer beside it."""
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig

from hybridlm.data.assets import tokenizer_path
from hybridlm.model import HybridForCausalLM
from upcycle.student import student_config

KINDS = ("mla", "mamba2", "mamba2", "mla")
# parameters our init leaves at constants (biases 0, norms 1, D 1): drawn at random, so the weight mapping
# cannot pass by mapping a constant
PERTURBED = ("z_bias", "conv1d.bias", ".D", "dt_bias", "norm.weight", "norm_weight")


def teacher_config(vocab_size: int) -> LlamaConfig:
    """Two KV heads of four query heads: Mamba2's x / B are shared by head pairs (two groups, so the order of their
    repetition matters); MLA's 16-wide heads run padded to 32."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=len(KINDS),
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                       max_position_embeddings=131072,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192})


def build_model(seed: int = 0, kinds=KINDS, vocab_size: int = 128256, **student) -> HybridForCausalLM:
    config = student_config(teacher_config(vocab_size), list(kinds), kv_lora_rank=student.pop("kv_lora_rank", 32),
                            qk_rope_head_dim=student.pop("qk_rope_head_dim", 8), **student)
    config.initializer_range = 0.1  # larger than the default 0.02: sharper logits, varied greedy tokens
    torch.manual_seed(seed)
    model = HybridForCausalLM(config, runtime={"backend": "torch"}).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(PERTURBED):
                p.add_(0.2 * torch.randn_like(p))
    return model


def build_export(out: Path, seed: int = 0, **student) -> Path:
    """The export folder (weights, config.json, Llama-3.2 tokenizer files)."""
    out = Path(out)
    build_model(seed, **student).save_pretrained(out)
    for f in tokenizer_path().iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out


if __name__ == "__main__":
    print(build_export(Path(sys.argv[1])))
