"""Greedy tokens from vLLM's offline engine for an export, in a process of its own (vLLM starts its engine and
sets process-wide environment, OpenMP and preloads, that must not leak into pytest).

    python vllm_greedy.py EXPORT RUNS_JSON NEW [DTYPE]

``RUNS_JSON``: a list of runs, each a list of prompts (lists of token ids); the runs go through one engine one
after the other, so a later run can reuse the prefix cache of an earlier one. Prints one line ``vllm_greedy: ``
``{"tokens": [run][prompt][ids], "cached": [run][prompt] prefix-cache hits, "params": {name: shape}}``."""
import importlib
import json
import os
import sys
from pathlib import Path

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


RESULT = "vllm_greedy: "  # vLLM logs to stdout too, also after this line: the result is the line with this prefix


def parameter_shapes(model) -> dict:
    return {name: list(p.shape) for name, p in model.named_parameters()}


def main(export: str, runs_json: str, new: int, dtype: str = "float32") -> None:
    # apply_model sends parameter_shapes to the worker by pickle, which vLLM allows only when asked
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # eager (torch.compile takes minutes on 2 cores); fp32 by default, as the toolkit's reference runs
    # 64-token steps: a long prompt is prefilled in chunks, the Mamba2 states and the KV cache carried across them
    llm = LLM(model=export, dtype=dtype, enforce_eager=True, max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=64,
              kv_cache_memory_bytes=256 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    tokens, cached = [], []
    for prompts in json.loads(runs_json):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        cached.append([o.num_cached_tokens or 0 for o in outs])
    # by its module's name, which vLLM's worker can import (a function of __main__ does not pickle)
    shapes = llm.apply_model(importlib.import_module("tests.serve.vllm_greedy").parameter_shapes)[0]
    print(RESULT + json.dumps({"tokens": tokens, "cached": cached, "params": shapes}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.serve
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
