"""The SFT and DPO tokenization of the demo sets with both tokenizers, as one JSON file: run it before and
after a change to the chat rendering and compare the two files (``cmp``); BENCHMARKS.md / the session notes
report such comparisons.

    python scripts/probes/chat_tokenization_snapshot.py OUT.json
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from distill.preference_data import load_preference_data, render_texts, tokenize_pair  # noqa: E402
from hybridlm.data import load_tokenizer  # noqa: E402
from hybridlm.data.chat import render_prompt  # noqa: E402
from hybridlm.data.sft import load_sft_data, tokenize_conversation  # noqa: E402
from hybridlm.teacher import load_teacher_tokenizer  # noqa: E402

SHARED = "data_cache/shared"  # python -m hybridlm.data fetch puts the demo sets here


def main(out: str) -> None:
    snapshot = {}
    for name, tok in (("llama", load_tokenizer("asset:llama3.2")), ("smol", load_teacher_tokenizer("asset:smollm2"))):
        convs = load_sft_data(f"{SHARED}/alpaca_en_demo.json")[:200]
        pairs = load_preference_data(f"{SHARED}/dpo_en_demo.json")[:100]
        snapshot[f"{name}_sft"] = [tokenize_conversation(tok, c, 256) for c in convs]
        snapshot[f"{name}_dpo"] = [tokenize_pair(tok, p, 256, 128) for p in pairs]
        snapshot[f"{name}_texts"] = [render_texts(tok, p) for p in pairs[:20]]
        snapshot[f"{name}_prompt"] = [render_prompt(tok, c[:-1]) for c in convs[:20]]
    with open(out, "w") as f:
        json.dump(snapshot, f)
    print(f"wrote {out}: {len(snapshot)} parts")


if __name__ == "__main__":
    main(sys.argv[1])
