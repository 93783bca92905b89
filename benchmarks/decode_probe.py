"""Where the eager decode step's time goes (BENCHMARKS.md, "Generation throughput"): the upcycling route's
architecture (random weights, bf16), one prompt prefilled into the dynamic cache, then single-token steps timed,
profiled with cProfile (Python functions) and with torch.profiler (ops per step). Eager decoding of a small model
is bound by the host: the figures say which Python functions and how many ops a step costs.

    python benchmarks/decode_probe.py [TEACHER_CONFIG_JSON] [--batch 1 --prompt 1024 --steps 30 --device cuda]

Without a config the teacher's shapes are SmolLM2-135M-Instruct's (benchmarks/route_twin.py).
DECODE_PROBE=1 bash benchmarks/generation.sh runs it at batch 1 / prompt 1024 and batch 48 / prompt 8192.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
from route_twin import route_config  # this folder is on sys.path when run as a script

from hybridlm.model import HybridForCausalLM
from hybridlm.utils.atomic import json_text


def route_twin(config_path, device: str) -> HybridForCausalLM:
    return HybridForCausalLM(route_config(config_path)[1]).to(device, torch.bfloat16).eval()


@torch.no_grad()
def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("config", nargs="?", default=None, help="the teacher's config.json (default: SmolLM2-135M's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda", help="cpu: a rehearsal (and the torch path's op count)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: decode_probe.py needs a CUDA GPU: torch.cuda.is_available() is False "
                         "(--device cpu for a rehearsal on the CPU)")
    torch.manual_seed(0)
    model = route_twin(args.config, args.device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)

    def steps(n):
        nonlocal nxt
        for _ in range(n):
            nxt = model(input_ids=nxt, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)

    steps(5)
    sync()
    t0 = time.perf_counter()
    steps(args.steps)
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    print(json_text({"eager_ms_per_step": ms, "batch": args.batch, "prompt": args.prompt}), flush=True)

    prof = cProfile.Profile()
    prof.enable()
    steps(args.steps)
    sync()
    prof.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(35)
        print(f"--- cProfile by {key}, {args.steps} steps\n" + s.getvalue(), flush=True)

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        steps(args.steps)
        sync()
    rows = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total_calls = sum(e.count for e in rows)
    print(f"--- torch ops: {total_calls / args.steps:.0f} per step", flush=True)
    for e in rows[:40]:
        print(f"{e.count / args.steps:8.1f}/step {e.self_cpu_time_total / args.steps / 1e3:8.3f} ms/step  {e.key[:100]}")


if __name__ == "__main__":
    main()
