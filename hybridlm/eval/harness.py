"""lm-evaluation-harness on a saved model, through its Python API and its ``hf`` model type.

How the hybrid gets into the harness: ``lm_eval``'s ``hf`` model (``HFLM``) is given the exported *directory*
(``pretrained=DIR``), not a model object, so the harness does its own loading exactly as it would for any
transformers checkpoint: ``AutoConfig`` / ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained(DIR)``.
That works without ``trust_remote_code`` because ``import hybridlm.model`` registers the ``hybrid_lm`` model
type with the Auto classes in this process, and the Auto class then calls ``HybridForCausalLM.from_pretrained``,
which is strict. ``backend="causal"`` is passed because the harness only auto-detects model types listed in
transformers' own tables. No ``trust_remote_code`` is passed and a saved model holds no code by default; a
loaded folder that still carries an ``auto_map`` (older exports) is loaded by the registered classes, its ``.py``
never runs. (The plain ``lm_eval`` CLI, which does not import the toolkit, needs an export made with the
``remote_code`` opt-in and ``trust_remote_code=True``, which runs the folder's ``hybrid_lm_auto.py``.)
A pre-built ``HFLM(pretrained=model_obj, ...)`` would also work but makes the harness ignore its device,
dtype and batch arguments; passing the directory keeps the harness' own ``hf`` path under test.

Local tasks (``austen_cloze``) are built on first use into the asset cache
(:func:`hybridlm.eval.build_tasks.ensure_local_tasks`) and added to the include paths, unless an
``--include-path`` already holds them. Task data is read from local JSONL files; nothing is downloaded.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import hybridlm.model  # noqa: F401  (registers hybrid_lm with AutoConfig / AutoModelForCausalLM for lm_eval's "hf")
from hybridlm.config.errors import ConfigError, last_line
from hybridlm.eval.build_tasks import LOCAL_TASKS, ensure_local_tasks

LM_EVAL_HINT = "pip install -e '.[eval]'"
HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _no_chat_template_advice(record: logging.LogRecord) -> bool:
    """lm_eval advises a chat template whenever the model's path names an instruct or chat model (the SmolLM2
    teacher's does). The harness's own and local tasks score plain text; a chat template would change them."""
    return "chat template is not applied" not in record.getMessage()


def _import_lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ConfigError(f"lm-eval: needs the lm_eval package ({LM_EVAL_HINT}): {e}") from None
    return lm_eval, TaskManager


def _has_task_yaml(paths: List[str], name: str) -> bool:
    return any(any(Path(p).expanduser().rglob(f"{name}.yaml")) for p in paths)


def summarize(results: Dict[str, Any]) -> Dict[str, Any]:
    """Per-task metrics (``acc``, ``acc_stderr``, ...; ``metric,filter`` keys keep the filter unless it is
    ``none``) and the number of items each task had and evaluated."""
    tasks: Dict[str, Dict[str, Any]] = {}
    for task, metrics in results.get("results", {}).items():
        row: Dict[str, Any] = {}
        for key, value in metrics.items():
            if key in ("alias", "name"):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else key
            if isinstance(value, (int, float)) or value is None:
                row[name] = value
            else:
                row[name] = str(value)  # "N/A" stderr and the like
        tasks[task] = row
    n_samples = {t: {"original": int(v["original"]), "effective": int(v["effective"])}
                 for t, v in results.get("n-samples", {}).items()}
    return {"tasks": tasks, "n_samples": n_samples, "n_shot": results.get("n-shot", {}),
            "higher_is_better": results.get("higher_is_better", {})}


def run_harness(kind: str, path: Path, gguf: Optional[str], tasks: List[str], include_paths: List[str],
                limit: Optional[float], batch_size: int, device: str, dtype: str,
                num_fewshot: Optional[int] = None, tokenizer=None, max_length: Optional[int] = None,
                seed: int = 1234) -> Dict[str, Any]:
    """Run ``lm_eval.simple_evaluate`` with ``model="hf"`` on the saved model; returns :func:`summarize`'s dict."""
    lm_eval, TaskManager = _import_lm_eval()
    paths = [str(Path(p).expanduser()) for p in include_paths]
    local = [t for t in tasks if t in LOCAL_TASKS and not _has_task_yaml(paths, t)]
    built = ensure_local_tasks(local)
    if built is not None:
        paths.append(str(built))
    # Indexing the harness' ~15k built-in tasks takes seconds: skip it when the include paths hold every task.
    manager = TaskManager(include_path=paths, include_defaults=False) if paths else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"lm-eval: unknown task(s) {', '.join(unknown)} (not a harness task nor in the include "
                          f"paths; local tasks: {', '.join(LOCAL_TASKS)})")

    model_args: Dict[str, Any] = {"pretrained": str(path), "backend": "causal", "dtype": HF_DTYPES[dtype],
                                  }  # device and batch_size go to simple_evaluate, which passes them on
    if gguf:
        model_args["gguf_file"] = gguf
    if tokenizer is not None:
        model_args["tokenizer"] = tokenizer
    if max_length is not None:
        model_args["max_length"] = max_length
    if limit is not None and float(limit).is_integer():
        limit = int(limit)
    evaluator_log = logging.getLogger("lm_eval.evaluator")
    evaluator_log.addFilter(_no_chat_template_advice)
    try:
        results = lm_eval.simple_evaluate(
            model="hf", model_args=model_args, tasks=tasks, num_fewshot=num_fewshot, batch_size=batch_size,
            device=device, limit=limit, task_manager=manager, log_samples=False, random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"lm-eval: {type(e).__name__}: {last_line(str(e))}") from None
    finally:
        evaluator_log.removeFilter(_no_chat_template_advice)
    if results is None:  # non-zero ranks under accelerate launch
        return {}
    out = summarize(results)
    out["limit"] = limit
    out["lm_eval_version"] = getattr(lm_eval, "__version__", None)
    try:
        from lm_eval.utils import make_table

        print(make_table(results), file=sys.stderr)
    except Exception:  # the table is a courtesy for humans; the JSON line is the result
        pass
    return out
