"""Random-weight twins of the upcycling route's models, for the generation benchmark (benchmarks/generation.sh)
and the decode probe: the route's hybrid (8 MLA layers spread evenly from layer 0, Mamba2 elsewhere, kv rank 128,
16 RoPE dims) and the teacher's Llama, with the teacher's shapes. Weights do not change the work per token, so a
twin measures what the trained model would, without training it (or, for the teacher, without its weights).

    python benchmarks/route_twin.py --save DIR [--save-teacher DIR] [--config TEACHER_CONFIG_JSON]
        [--n-mla 8 --kv-lora-rank 128 --qk-rope-head-dim 16] [--shapes 16x1024,8x777]

Without ``--config`` the teacher's shapes are SmolLM2-135M-Instruct's (``asset:smollm2``: 30 layers, width 576,
9 heads, 3 KV heads, vocabulary 49,152), so no teacher needs to be fetched. ``--shapes`` also runs two forward +
backward passes per ``BATCHxLENGTH`` on the GPU first (bf16 autocast): Triton's autotune results for those shapes
land in ``$TRITON_CACHE_DIR`` for the runs after it. Saved models are bf16.
"""
import argparse
import json
import time

# SmolLM2-135M-Instruct's configuration (the route's teacher, asset:smollm2)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
               tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192)


def route_config(teacher_config=None, n_mla: int = 8, kv_lora_rank: int = 128, qk_rope_head_dim: int = 16):
    """The route's hybrid config from the teacher's config.json (None: SmolLM2-135M's): ``n_mla`` MLA layers spread
    evenly from layer 0, Mamba2 elsewhere. Returns (the teacher's LlamaConfig, the hybrid's config)."""
    from transformers import LlamaConfig

    from upcycle.student import student_config
    llama = LlamaConfig(**SMOLLM2) if teacher_config is None else \
        LlamaConfig.from_dict(json.load(open(teacher_config)))
    L = llama.num_hidden_layers
    layer_kinds = ["mla" if i % (L // n_mla) == 0 and i // (L // n_mla) < n_mla else "mamba2" for i in range(L)]
    return llama, student_config(llama, layer_kinds, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", default=None, metavar="JSON",
                   help="the teacher's config.json (default: SmolLM2-135M-Instruct's shapes)")
    p.add_argument("--n-mla", type=int, default=8)
    p.add_argument("--kv-lora-rank", type=int, default=128)
    p.add_argument("--qk-rope-head-dim", type=int, default=16)
    p.add_argument("--shapes", default="", help="BATCHxLENGTH pairs (comma-separated) to run forward + backward on "
                                                 "the GPU before saving (autotunes them); default none")
    p.add_argument("--save", default=None, metavar="DIR", help="save the random-weight hybrid here")
    p.add_argument("--save-teacher", default=None, metavar="DIR",
                   help="save a random-weight LlamaForCausalLM of the teacher's config here")
    args = p.parse_args()
    if not (args.save or args.save_teacher or args.shapes):
        p.error("nothing to do: give --save, --save-teacher or --shapes")

    import torch

    from hybridlm.model import HybridForCausalLM
    if args.shapes and not torch.cuda.is_available():
        raise SystemExit("error: route_twin.py --shapes needs a CUDA GPU: torch.cuda.is_available() is False")
    torch.manual_seed(0)
    llama, cfg = route_config(args.config, args.n_mla, args.kv_lora_rank, args.qk_rope_head_dim)
    model = HybridForCausalLM(cfg)
    if args.shapes:
        model.cuda()
        for shape in args.shapes.split(","):
            b, t = (int(v) for v in shape.split("x"))
            ids = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")
            t0 = time.perf_counter()
            for _ in range(2):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(ids, labels=ids).loss
                loss.backward()
            torch.cuda.synchronize()
            print(f"route_twin {shape}: {time.perf_counter() - t0:.1f}s (loss {loss.item():.3f})", flush=True)
    if args.save:
        model.to(torch.bfloat16).save_pretrained(args.save)
        print(f"saved the route's hybrid twin to {args.save}", flush=True)
    if args.save_teacher:
        from transformers import LlamaForCausalLM

        LlamaForCausalLM(llama).to(torch.bfloat16).save_pretrained(args.save_teacher)
        print(f"saved the teacher's twin to {args.save_teacher}", flush=True)


if __name__ == "__main__":
    main()
