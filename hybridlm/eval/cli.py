"""``hybrid-eval``: perplexity on text, and lm-evaluation-harness tasks, for saved hybrids and Llama teachers.

    hybrid-eval ppl --model runs/x/final --text notes.txt asset:janeausten --seq-len 1024 --max-tokens 65536
    hybrid-eval ppl --model asset:smollm2 --dataset DIR_OR_NAME[:split] [--text-field text]
    hybrid-eval lm-eval --model runs/x/final --tasks austen_cloze --limit 200 --batch-size 8
    hybrid-eval ruler --model asset:smollm2 runs/x/final --lengths 4096 8192 --items 20 --out ruler/ruler.json

(also ``python -m hybridlm.eval ...``). ``--model`` is a saved hybrid directory (``HybridForCausalLM``, loaded
strictly: a missing or unexpected weight is an error), a Llama teacher directory, a ``.gguf`` file or
``asset:smollm2``; the tokenizer is the one saved with the model unless ``--tokenizer`` names another.
Each command prints one JSON line (and writes it, indented, to ``--out``); bad input is one ``error:`` line
on stderr and exit status 2.

``ruler`` builds RULER's synthetic long-context tasks from local text (:mod:`hybridlm.eval.ruler`; needle in a
haystack, variable tracking, common / frequent words extraction) at each ``--lengths`` in every model's own tokens,
scores each model's greedy answers by RULER's string match, and writes ``--out`` (JSON), a Markdown table and a
PNG beside it (docs/long_context.md).

``ppl`` reads text the way ``hybrid-prepare`` does (:mod:`hybridlm.data.prepare`: ``.txt`` files whole,
``.json``/``.jsonl``/``.parquet`` records by ``--text-field`` or alpaca fields, folders, ``asset:janeausten``),
or the records of a ``datasets`` dataset (a local folder, a ``save_to_disk`` folder or a hub name) and split.
Texts are tokenized without special tokens, joined with EOS, cut into consecutive ``--seq-len`` windows up to
``--max-tokens`` predicted tokens (0 = all); ppl = exp(token-mean next-token NLL).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

import hybridlm.model  # noqa: F401  (registers hybrid_lm with the Auto classes: AutoTokenizer / AutoModel read config.json)
from hybridlm.config.errors import ConfigError, last_line, weight_load_errors
from hybridlm.data.assets import ASSET_PREFIX, TOKENIZER_NAME, load_tokenizer
from hybridlm.data.packed import heldout_windows, read_meta
from hybridlm.data.prepare import _record_text, iter_documents
from hybridlm.eval.harness import run_harness
from hybridlm.eval.perplexity import perplexity, token_stream, windows_from_ids
from hybridlm.eval.ruler import evaluate_model, load_haystack, resolve_tasks, ruler_result, write_ruler_outputs
from hybridlm.eval.ruler.haystack import DEFAULT_HAYSTACK
from hybridlm.teacher import load_teacher, load_teacher_tokenizer, resolve_teacher
from hybridlm.utils.atomic import json_text, write_json

DTYPES = ("fp32", "bf16")
HYBRID_MODEL_TYPE = "hybrid_lm"  # HybridConfig.model_type (not imported here: keeps bad-input errors fast)


# ------------------------------------------------------------------------------------------ models
def resolve_model(spec: str) -> Tuple[str, Path, Optional[str]]:
    """(kind, directory, gguf file name or None) for ``--model``; kind is ``hybrid`` or ``llama``.

    Only reads config.json: every check that needs no weights happens before anything heavy is loaded."""

    if spec.startswith(ASSET_PREFIX):
        return "llama", resolve_teacher(spec), None
    p = Path(spec).expanduser()
    if not p.exists():
        raise ConfigError(f"model {spec!r}: no such file or directory")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ConfigError(f"model {spec!r}: expected a saved model directory or a .gguf file")
        return "llama", p.parent, p.name
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"model {spec!r}: expected a saved model directory with a config.json (none found)")
    try:
        model_type = json.loads(cfg_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{cfg_file}: not a valid config.json ({e})") from None
    if model_type == HYBRID_MODEL_TYPE:
        return "hybrid", p, None
    if model_type == "llama":
        return "llama", p, None
    raise ConfigError(f"model {spec!r}: model_type {model_type!r}; expected {HYBRID_MODEL_TYPE!r} (a saved hybrid) "
                      f"or 'llama' (a teacher)")


def torch_dtype(name: str):
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def resolve_device(spec: str):
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"device {spec!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r}: CUDA is not available on this machine")
    return dev


def load_model(kind: str, path: Path, gguf: Optional[str], dtype: str, device):
    """The model in eval mode on ``device``. Hybrids load through ``AutoModelForCausalLM`` (the type is
    registered on ``import hybridlm.model``), whose ``from_pretrained`` is strict; Llama teachers through
    :func:`hybridlm.teacher.load_teacher` (strict too)."""
    try:
        if kind == "llama":
            model = load_teacher(path / gguf if gguf else path, dtype=torch_dtype(dtype))
        else:
            from transformers import AutoModelForCausalLM
            try:
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype))
            except weight_load_errors() as e:
                raise ConfigError(f"{path}: cannot be loaded as a hybrid ({last_line(str(e))})") from None
    except pickle.UnpicklingError as e:  # a pickled weights file (pytorch_model.bin) naming code to run
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        named = f"references {found.group(1)}" if found else "holds more than tensors"
        raise ConfigError(f"{path}: a pickled weights file there (pytorch_model.bin) {named}; refusing to "
                          f"unpickle it (a pickle can run code); use a model saved as safetensors") from None
    return model.to(device).eval()


def load_eval_tokenizer(path: Path, gguf: Optional[str], override: Optional[str]):
    """The model's own tokenizer, or ``override``: ``asset:llama3.2``, a tokenizer.json, or a model directory."""
    if override:
        p = Path(override).expanduser()
        if override == ASSET_PREFIX + TOKENIZER_NAME or p.is_file() or (p.is_dir() and not (p / "tokenizer_config.json").is_file()):
            return load_tokenizer(override)
        return load_teacher_tokenizer(override)
    try:
        return load_teacher_tokenizer(path / gguf if gguf else path)
    except ConfigError as e:
        raise ConfigError(f"{e}; pass --tokenizer (e.g. asset:llama3.2)") from None


# -------------------------------------------------------------------------------------------- text
def text_documents(specs: List[str], text_field: str) -> Iterator[str]:
    """Documents of ``--text`` sources; each must exist (a missing path is never taken for a dataset name)."""

    for spec in specs:  # an asset: name (e.g. asset:sotu, the held-out corpus) is checked by resolve_source
        if not spec.startswith(ASSET_PREFIX) and not Path(spec).expanduser().exists():
            raise ConfigError(f"text {spec!r}: no such file or directory")
    return iter_documents(specs, text_field=text_field)


def dataset_documents(spec: str, text_field: str, config: Optional[str] = None) -> Iterator[str]:
    """Documents of ``NAME[:split]`` (split default ``train``): a ``save_to_disk`` folder, a folder of data
    files, or a dataset name for ``datasets.load_dataset``. Records become text as in ``hybrid-prepare``."""
    import datasets

    name, _, split = spec.partition(":")
    split = split or "train"
    p = Path(name).expanduser()
    try:
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"dataset {spec!r}: no split {split!r} (splits: {', '.join(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(str(p) if p.exists() else name, config, split=split)
    except ConfigError:
        raise
    except Exception as e:  # network, unknown name, unknown split: one line for the user
        raise ConfigError(f"dataset {spec!r}: cannot be loaded ({type(e).__name__}: {last_line(str(e))})") from None
    for i, rec in enumerate(ds):
        text = _record_text(rec, text_field, f"dataset {spec!r} row {i}")
        if text.strip():
            yield text


# --------------------------------------------------------------------------------------------- ppl
def run_ppl(args) -> Dict[str, Any]:
    if args.seq_len < 1 or args.batch_size < 1 or args.max_tokens < 0:
        raise ConfigError("--seq-len and --batch-size must be >= 1, --max-tokens >= 0 (0 = all text)")
    kind, path, gguf = resolve_model(args.model)
    source = " ".join(args.text) if args.text else (args.dataset or args.packed)
    docs = None
    if args.text or args.dataset:
        docs = (text_documents(args.text, args.text_field) if args.text
                else dataset_documents(args.dataset, args.text_field, args.dataset_config))
        first = next(docs, None)  # before any model or tokenizer is loaded: empty input fails fast
        if first is None:
            raise ConfigError(f"text {source}: no text to evaluate (empty or blank)")
        docs = itertools.chain([first], docs)
    device = resolve_device(args.device)
    t0 = time.perf_counter()
    tok = load_eval_tokenizer(path, gguf, args.tokenizer)
    tok.model_max_length = 1 << 40  # whole documents are tokenized, then windowed: no length warning
    seq_len = args.seq_len
    if docs is None:
        windows = packed_windows(args.packed, tok, seq_len, args.max_tokens)
    else:
        limit = args.max_tokens + seq_len + 1 if args.max_tokens else None
        ids = token_stream(tok, docs, limit)
        if len(ids) < 2:
            raise ConfigError(f"text {source}: too short to evaluate (needs 2 tokens, has {len(ids)})")
        seq_len = min(seq_len, len(ids) - 1)  # shorter than one window: one window of all of it
        windows = windows_from_ids(ids, seq_len, args.max_tokens or len(ids))
    model = load_model(kind, path, gguf, args.dtype, device)
    vocab = model.get_output_embeddings().weight.shape[0]
    top = max(int(w.max()) for w in windows)
    if top >= vocab:
        raise ConfigError(f"tokenizer: id {top} is outside the model's vocabulary of {vocab} "
                          f"(wrong --tokenizer for this model?)")
    stats = perplexity(model, windows, batch_size=args.batch_size)
    return {
        "command": "ppl", "model": args.model, "model_type": kind,
        "params": sum(p.numel() for p in model.parameters()), "source": source,
        "seq_len": seq_len, "windows": len(windows), "tokens": stats["tokens"],
        "nll": stats["nll"], "ppl": stats["ppl"], "dtype": args.dtype, "device": str(device),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def packed_windows(data_path: str, tok, seq_len: int, max_tokens: int):
    """Windows of the validation split of ``hybrid-prepare`` output (:func:`hybridlm.data.packed.heldout_windows`),
    after checking that it was tokenized with the model's tokenizer (vocabulary size and EOS id)."""

    if not Path(data_path).expanduser().is_dir():
        raise ConfigError(f"packed {data_path!r}: no such directory")
    meta = read_meta(Path(data_path).expanduser())
    want = meta.get("tokenizer", {})
    if want.get("vocab_size") != len(tok) or want.get("eos_id") != tok.eos_token_id:
        raise ConfigError(f"packed {data_path!r}: tokenized with vocab {want.get('vocab_size')} / eos "
                          f"{want.get('eos_id')}, the model's tokenizer has {len(tok)} / {tok.eos_token_id}")
    return heldout_windows(Path(data_path).expanduser(), seq_len, max_tokens or (1 << 62))


# ------------------------------------------------------------------------------------------ lm-eval
def run_lm_eval(args) -> Dict[str, Any]:
    tasks = [t for spec in args.tasks for t in spec.split(",") if t]
    if not tasks:
        raise ConfigError("--tasks: name at least one task")
    if args.batch_size < 1 or (args.limit is not None and args.limit <= 0):
        raise ConfigError("--batch-size must be >= 1 and --limit > 0")
    kind, path, gguf = resolve_model(args.model)
    for ip in args.include_path or []:
        if not Path(ip).expanduser().is_dir():
            raise ConfigError(f"include path {ip!r}: no such directory")
    device = resolve_device(args.device)
    tokenizer = load_eval_tokenizer(path, gguf, args.tokenizer) if args.tokenizer else None
    t0 = time.perf_counter()
    out = run_harness(kind=kind, path=path, gguf=gguf, tasks=tasks, include_paths=args.include_path or [],
                      limit=args.limit, batch_size=args.batch_size, device=str(device), dtype=args.dtype,
                      num_fewshot=args.num_fewshot, tokenizer=tokenizer, max_length=args.max_length,
                      seed=args.seed)
    return {"command": "lm-eval", "model": args.model, "model_type": kind, **out,
            "device": str(device), "dtype": args.dtype, "seconds": round(time.perf_counter() - t0, 2)}


# -------------------------------------------------------------------------------------------- ruler
def run_ruler(args) -> Dict[str, Any]:
    tasks = resolve_tasks(args.tasks)
    if not args.lengths or any(L < 64 for L in args.lengths) or args.items < 1:
        raise ConfigError("--lengths: each at least 64 tokens; --items: at least 1")
    if args.labels and len(args.labels) != len(args.model):
        raise ConfigError(f"--labels: {len(args.labels)} given for {len(args.model)} models")
    lengths = sorted(set(args.lengths))
    resolved = [resolve_model(spec) for spec in args.model]  # every model checked before any is loaded
    check_writable(args.ruler_out)
    device = resolve_device(args.device)
    hay = load_haystack(args.haystack)
    kinds = [kind for kind, _, _ in resolved]
    labels = args.labels or [default_label(spec, kind, kinds) for spec, kind in zip(args.model, kinds)]
    models = []
    for spec, label, (kind, path, gguf) in zip(args.model, labels, resolved):
        tok = load_eval_tokenizer(path, gguf, args.tokenizer)
        model = load_model(kind, path, gguf, args.dtype, device)
        r = evaluate_model(model, tok, label, tasks, lengths, args.items, hay, seed=args.seed, chat=args.chat)
        models.append({"model": spec, "model_type": kind, **r})
        del model
    result = ruler_result(models, tasks, lengths, args.items, hay, args.seed)
    result.update(device=str(device), dtype=args.dtype)
    files = write_ruler_outputs(result, Path(args.ruler_out).expanduser())
    return {"command": "ruler", "files": files, "lengths": lengths, "items": args.items,
            "models": [{"model": m["model"], "label": m["label"], "average": m["average"], "scores": m["scores"]}
                       for m in models]}


def default_label(spec: str, kind: str, kinds: List[str]) -> str:
    """``teacher`` / ``hybrid`` by model type, or the model's name when several models share a type."""
    name = "teacher" if kind == "llama" else "hybrid"
    if kinds.count(kind) == 1:
        return name
    return spec if spec.startswith(ASSET_PREFIX) else f"{name} ({Path(spec).expanduser().resolve().name})"


# --------------------------------------------------------------------------------------------- CLI
def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="saved hybrid dir, Llama teacher dir, .gguf file or asset:smollm2")
    p.add_argument("--tokenizer", default=None, help="tokenizer instead of the model's own (asset:llama3.2, "
                                                     "a tokenizer.json or a model dir)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--out", default=None, help="also write the result here (JSON)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybrid-eval", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ppl", help="perplexity on text files or a dataset")
    _add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+",
                     help=".txt/.json/.jsonl/.parquet files or folders, corpora (asset:janeausten, asset:sotu, ...)")
    src.add_argument("--dataset", help="NAME[:split] (split default train): a datasets folder or name")
    src.add_argument("--packed", help="hybrid-prepare output folder: its validation split")
    p.add_argument("--dataset-config", default=None, help="the dataset's config name, if it has several")
    p.add_argument("--text-field", default="text", help="record field holding the text (alpaca records: automatic)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=65536, help="predicted tokens to score at most (0 = all)")
    p.set_defaults(func=run_ppl)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on the model (its `hf` model type)")
    _add_model_args(p)
    p.add_argument("--tasks", nargs="+", required=True, help="task names (comma- or space-separated); "
                                                             "local tasks: austen_cloze")
    p.add_argument("--include-path", nargs="+", default=None, help="extra folders of task YAMLs")
    p.add_argument("--limit", type=float, default=None, help="items per task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--max-length", type=int, default=None, help="context length for the harness (default: its own)")
    p.add_argument("--seed", type=int, default=1234)
    p.set_defaults(func=run_lm_eval)

    p = sub.add_parser("ruler", help="RULER-style long-context tasks built from local text (needle in a haystack, "
                                     "variable tracking, common / frequent words)")
    p.add_argument("--model", nargs="+", required=True,
                   help="one or more models (a teacher and its hybrid are drawn side by side): saved hybrid dirs, "
                        "Llama teacher dirs, .gguf files or asset:smollm2")
    p.add_argument("--labels", nargs="+", default=None, help="a label per --model (default: teacher / hybrid)")
    p.add_argument("--tokenizer", default=None, help="tokenizer instead of each model's own")
    p.add_argument("--tasks", nargs="+", default=["all"],
                   help="task names or groups (all, niah): niah_single_1..3, niah_multikey_1..3, niah_multivalue, "
                        "niah_multiquery, vt, cwe, fwe")
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192],
                   help="context lengths in the model's tokens (prompt + generation budget)")
    p.add_argument("--items", type=int, default=20, help="items per task and length")
    p.add_argument("--seed", type=int, default=0,
                   help="items are drawn from (seed, task, length, index): the same on every run")
    p.add_argument("--haystack", nargs="+", default=[DEFAULT_HAYSTACK],
                   help="text the haystacks and word lists come from: asset:<corpus>, .txt/.jsonl files or folders")
    p.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                   help="wrap each prompt in the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--out", dest="ruler_out", default="ruler.json",
                   help="result JSON (every item's prediction); the .md table and .png plot go beside it")
    p.set_defaults(func=run_ruler, out=None)
    return ap


def check_writable(path) -> None:
    """Fail before the evaluation, not after it, when ``--out`` cannot be written."""
    p = Path(path).expanduser()
    probe = p.with_name(f".{p.name}.probe-{os.getpid()}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("", encoding="utf-8")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out: cannot write {p} ({e.strerror or e})") from None
    if p.is_dir():
        raise ConfigError(f"--out: {p} is a directory; give a file path such as {p / 'result.json'}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.out:
            check_writable(args.out)
        result = args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json_text(result), flush=True)  # the result first: a failed write below must not lose it
    if args.out:
        try:
            write_json(Path(args.out).expanduser(), result)
        except OSError as e:
            print(f"error: --out: cannot write {args.out} ({e.strerror or e}); the result is on stdout", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
