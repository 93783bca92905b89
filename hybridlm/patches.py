"""Every change the toolkit makes to another library's code, declared in one place.

:data:`PATCHES` lists them. Each :class:`Patch` names what it changes (``module:attribute`` targets), the versions
of the packages it was written against, why it exists, and the modules that apply it; its install function is
below its declaration. Code elsewhere never assigns to another library's attributes (tests/test_patches.py reads
the toolkit's source and fails on it): it calls :func:`apply` for a patch that stays for the rest of the process,
or opens :func:`scope` for one in place only while a block runs.

* **Idempotent.** Applying a process-wide patch again changes nothing (each install looks at what is in place
  first), and nested or concurrent ``scope`` blocks of one patch install it once, when the first opens, and undo
  it when the last closes.
* **Version guard.** Where an installed package a patch targets is outside the versions the patch was written
  against, the patch is still installed (what it works around is still there, and the code that applies it relies
  on it) and a :class:`PatchVersionWarning` says so, once per patch and process: read the patch's reason against
  the new version, then widen its ``versions`` or change it. A target the package no longer has fails with a
  :class:`PatchError` naming the patch, the target and the versions.

This module imports nothing of the toolkit, and of other packages only torch at import time: each install
imports its targets by name when it runs.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import platform
import re
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch.distributed as dist


class PatchError(RuntimeError):
    """A patch's target is not where the patch expects it (the package changed)."""


class PatchVersionWarning(UserWarning):
    """A patch was installed on a package version outside those it was written against."""


@dataclass(frozen=True)
class Patch:
    name: str
    # what it changes: ``module:Attribute.path`` (``module:*.__defaults__``: an attribute of each function there)
    targets: Tuple[str, ...]
    # the versions it was written against: importable package (``python``: the interpreter) -> ``>=A,<B``
    versions: Mapping[str, str]
    reason: str
    # the toolkit modules that apply it (tests/test_patches.py holds this list to the source)
    applied_by: Tuple[str, ...]
    install: Callable[..., Optional[Callable[[], None]]]
    # installed only while a ``scope`` block is open; its install returns the undo
    scoped: bool = False


PATCHES: Dict[str, Patch] = {}
_MARK = "_hybridlm_patch"  # set on each replacement function: the name of the patch that installed it
_LOCK = threading.RLock()
_OPEN: Dict[str, Tuple[int, Callable[[], None]]] = {}  # scoped patch -> (open blocks, undo)
_GUARDED: set = set()


def _declare(name: str, *, targets: Tuple[str, ...], versions: Mapping[str, str], reason: str,
             applied_by: Tuple[str, ...], scoped: bool = False):
    def register(install):
        PATCHES[name] = Patch(name, targets, dict(versions), " ".join(reason.split()), applied_by, install, scoped)
        return install
    return register


# ------------------------------------------------------------------------------------------------ applying

def apply(name: str, *args: Any, **kwargs: Any) -> None:
    """Install the process-wide patch ``name`` (with its install's arguments), or leave it as it is if in place."""
    patch = _patch(name, scoped=False)
    with _LOCK:
        _guard(patch, stacklevel=3)
        patch.install(patch, *args, **kwargs)


@contextlib.contextmanager
def scope(name: str, *args: Any, **kwargs: Any) -> Iterator[None]:
    """The scoped patch ``name`` in place inside the block (installed with the arguments of the block that opens
    first while none is open)."""
    patch = _patch(name, scoped=True)
    with _LOCK:
        count, undo = _OPEN.get(name, (0, None))
        if count == 0:
            _guard(patch, stacklevel=4)
            undo = patch.install(patch, *args, **kwargs)
        _OPEN[name] = (count + 1, undo)
    try:
        yield
    finally:
        with _LOCK:
            count, undo = _OPEN.pop(name)
            if count > 1:
                _OPEN[name] = (count - 1, undo)
            else:
                undo()


def open_scopes() -> List[str]:
    """The scoped patches in place now."""
    with _LOCK:
        return sorted(_OPEN)


def _patch(name: str, scoped: bool) -> Patch:
    patch = PATCHES.get(name)
    if patch is None:
        raise KeyError(f"no patch {name!r} (hybridlm/patches.py declares {', '.join(PATCHES)})")
    if patch.scoped != scoped:
        raise TypeError(f"patch {name!r} is {'scoped: use scope()' if patch.scoped else 'process-wide: use apply()'}")
    return patch


# ------------------------------------------------------------------------------------------------ version guard

def release(version: str) -> Tuple[int, ...]:
    """The release numbers a version starts with: ``2.13.0+cpu`` -> (2, 13, 0), ``3.10.0rc1`` -> (3, 10, 0)."""
    m = re.match(r"\d+(\.\d+)*", version.strip())
    if m is None:
        raise ValueError(f"version {version!r}: expected it to start with release numbers (1.2.3)")
    return tuple(int(p) for p in m.group(0).split("."))


def within(version: str, spec: str) -> bool:
    """Whether ``version`` meets ``spec``, clauses ``>=A`` and ``<B`` joined by commas (release numbers only)."""
    have = release(version)
    for clause in spec.split(","):
        clause = clause.strip()
        op = ">=" if clause.startswith(">=") else "<" if clause.startswith("<") else None
        if op is None:
            raise ValueError(f"version spec {spec!r}: expected clauses >=A or <B joined by commas")
        bound = release(clause[len(op):])
        width = max(len(have), len(bound))
        a, b = have + (0,) * (width - len(have)), bound + (0,) * (width - len(bound))
        if (op == ">=" and a < b) or (op == "<" and a >= b):
            return False
    return True


def installed_version(package: str) -> Optional[str]:
    """The version of ``package`` here (its module's ``__version__``; ``python``: the interpreter's); None where it
    is not installed."""
    if package == "python":
        return platform.python_version()
    try:
        module = sys.modules.get(package) or importlib.import_module(package)
    except ImportError:
        return None
    return str(getattr(module, "__version__", "")) or None


def outside_versions(patch: Patch) -> List[str]:
    """``package version (written for SPEC)`` for each installed package the patch targets outside its versions."""
    out = []
    for package, spec in patch.versions.items():
        version = installed_version(package)
        if version is not None and not within(version, spec):
            out.append(f"{package} {version} (written for {package}{spec})")
    return out


def _guard(patch: Patch, stacklevel: int) -> None:
    if patch.name in _GUARDED:
        return
    _GUARDED.add(patch.name)
    off = outside_versions(patch)
    if off:
        warnings.warn(PatchVersionWarning(
            f"patch {patch.name}: installed on {', '.join(off)}; check its reason in hybridlm/patches.py against "
            f"this version"), stacklevel=stacklevel)  # the line that applies it


# ------------------------------------------------------------------------------------------------ targets

def _resolve(patch: Patch, target: str) -> Tuple[Any, str]:
    """``(owner, attribute)`` of ``module:Path.to.attribute`` (for ``module:*...``: the module and ``*``)."""
    module_name, _, path = target.partition(":")
    module = importlib.import_module(module_name)
    if path.startswith("*"):
        return module, "*"
    *owners, attr = path.split(".")
    owner = module
    try:
        for part in owners:
            owner = getattr(owner, part)
        getattr(owner, attr)
    except AttributeError:
        raise PatchError(f"patch {patch.name}: {target} does not exist here (written for "
                         f"{', '.join(p + s for p, s in patch.versions.items())})") from None
    return owner, attr


def _wrap(patch: Patch, target: str, make: Callable[[Callable], Callable], once: bool = False) -> Callable[[], None]:
    """Replace ``target`` by ``make(original)`` (marked with the patch's name); the undo puts the original back.
    ``once``: leave a replacement this patch already put there."""
    owner, attr = _resolve(patch, target)
    original = getattr(owner, attr)
    if once and getattr(original, _MARK, None) == patch.name:
        return lambda: None
    replacement = make(original)
    setattr(replacement, _MARK, patch.name)
    setattr(owner, attr, replacement)
    return lambda: setattr(owner, attr, original)


def installed_by(obj: Any) -> Optional[str]:
    """The patch that put ``obj`` (a replacement function) in place, if one did."""
    return getattr(obj, _MARK, None)


# ------------------------------------------------------------------------------------------------ the patches

@_declare(
    "autotuner-shipped-results",
    targets=("triton.runtime.autotuner:Autotuner.check_disk_cache",),
    versions={"triton": ">=3.7,<3.10"},
    reason="""Triton times every candidate configuration of an autotuned kernel the first time a launch meets a
    tuning key, minutes on a fresh GPU machine. ``check_disk_cache`` (called with the tuning key and the pruned
    candidates, before timing them) is the one step that can hand the autotuner a winner found elsewhere, and
    Triton has no hook for it: wrapped, it serves the winners shipped in hybridlm/ops/tuned/ first and records
    launches it had to time under HYBRIDLM_RECORD_TUNING (hybridlm/ops/tuning.py ``serving_check``).""",
    applied_by=("hybridlm.ops.tuning",))
def _autotuner_serves(patch: Patch, wrap: Callable[[Callable], Callable]) -> None:
    """``wrap(original)`` in place of ``Autotuner.check_disk_cache``, once: a later apply keeps the first."""
    _wrap(patch, patch.targets[0], wrap, once=True)


@_declare(
    "deepspeed-shm-comm-off",
    targets=("deepspeed.ops:__compatible_ops__",),
    versions={"deepspeed": ">=0.19.8,<0.20"},
    reason="""deepspeed.comm JIT-compiles its CPU shared-memory collective op (about 200 s a process) where
    ``deepspeed.ops.__compatible_ops__`` says it is buildable; training here goes through plain gloo / NCCL
    collectives and never uses it, so its entry ``deepspeed_shm_comm`` is set False before the process group
    exists.""",
    applied_by=("hybridlm.engine.distributed",))
def _shm_comm_off(patch: Patch) -> None:
    owner, attr = _resolve(patch, patch.targets[0])
    getattr(owner, attr)["deepspeed_shm_comm"] = False


# Modules of torch whose functions take ``group=group.WORLD`` as a default argument, evaluated when the module is
# imported (torch/distributed/nn/functional.py: broadcast, gather, scatter, reduce, reduce_scatter, all_gather,
# _all_gather_base, all_to_all, all_to_all_single, all_reduce)
GROUP_DEFAULT_MODULES = ("torch.distributed.nn.functional",)


@_declare(
    "torch-group-defaults-unpinned",
    targets=tuple(f"{m}:*.__defaults__" for m in GROUP_DEFAULT_MODULES),
    versions={"torch": ">=2.6,<2.14"},
    reason="""torch.distributed.nn.functional's functions take ``group=group.WORLD`` as a default, evaluated at
    import: imported while a process group exists, the module freezes that ProcessGroup into the functions'
    ``__defaults__``, out of reach of ``destroy_process_group``, and a gloo group (with its gloo_tcp_loop and two
    pt_gloo_runloop threads) then lives until interpreter teardown, where a thread ended in its destructor can
    abort the rank. Nobody here imports the module on purpose, but the first
    ``torch.optim.Optimizer.add_param_group`` call imports torch._dynamo, which pulls it in (through
    torch.distributed.fsdp -> _shard -> sharded_tensor.reshard). Applied before the default group exists (the
    import then leaves the defaults None, which these functions read as the current default group) and after
    the groups are destroyed (a group frozen by an import we did not order is dropped).""",
    applied_by=("hybridlm.engine.distributed",))
def _group_defaults_unpinned(patch: Patch) -> None:
    """Each module of :data:`GROUP_DEFAULT_MODULES` imported, and no function of it holding a ProcessGroup as a
    default. Meant for moments when no process group exists (then the import itself leaves them None)."""
    if not dist.is_available():  # a torch without torch.distributed has nothing to pin a group
        return
    for name in GROUP_DEFAULT_MODULES:
        if name not in sys.modules and not dist.is_initialized():
            importlib.import_module(name)
        module = sys.modules.get(name)
        if module is None:
            continue
        for fn in list(vars(module).values()):
            defaults = getattr(fn, "__defaults__", None)
            if getattr(fn, "__module__", None) == name and defaults and \
                    any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


@_declare(
    "transformers-messages-held",
    targets=("logging:Logger.handle", "logging:Logger.warning_once", "logging:Logger.info_once", "warnings:warn"),
    versions={"python": ">=3.10,<3.14", "transformers": ">=5.17,<6"},
    reason="""generate()'s fast path judges a call with transformers' own set-up code, which logs and warns; what
    it says must be said only if the fast path is taken (transformers' loop, when taken, says it again itself).
    transformers logs through stdlib loggers (each record goes through ``Logger.handle``), through the
    ``warning_once`` / ``info_once`` methods it adds to ``logging.Logger``, and warns through ``warnings.warn``;
    none takes a hook, so each is wrapped to hand the message to a list when ``holding(name)`` gives one
    (hybridlm/model/fast_generate.py ``HeldBack``). Python 3.14 rewrote the warnings module.""",
    applied_by=("hybridlm.model.fast_generate",),
    scoped=True)
def _messages_held(patch: Patch, holding: Callable[[str], Optional[List[Callable[[], None]]]]) -> Callable[[], None]:
    """While in place, a record of logger ``L`` is appended (as a call that says it) to ``holding(L)`` when that
    is a list, and said as usual when it is None; a ``*_once`` call likewise (replayed as the call, so its
    once-only memory is the one it would have had); a Python warning is held by the name of the module that
    warns, and replayed with the location, registry and module ``warnings.warn`` would have given it."""
    handle_target, *once_targets, warn_target = patch.targets

    def held_handle(original):
        def handle(logger, record):
            held = holding(logger.name)
            if held is None:
                return original(logger, record)
            held.append(functools.partial(original, logger, record))
        return handle

    def held_once(original):
        def call(logger, *args, **kwargs):
            held = holding(logger.name)
            if held is None:
                return original(logger, *args, **kwargs)
            held.append(functools.partial(original, logger, *args, **kwargs))
        return call

    def held_warn(original):
        def warn(message, category=None, stacklevel=1, source=None, **kwargs):
            held = holding(sys._getframe(1).f_globals.get("__name__", ""))  # by the module that warns
            if held is None:
                return original(message, category, stacklevel + 1, source, **kwargs)
            # the location warnings.warn gives a warning: the frame stacklevel up from its caller
            try:
                frame = sys._getframe(stacklevel)
                scope_, filename, lineno = frame.f_globals, frame.f_code.co_filename, frame.f_lineno
            except ValueError:
                scope_, filename, lineno = sys.__dict__, "sys", 1
            module = scope_.get("__name__", "<string>")
            if isinstance(message, Warning):
                category = type(message)
            held.append(functools.partial(warnings.warn_explicit, message, category or UserWarning, filename, lineno,
                                          module, scope_.setdefault("__warningregistry__", {}), scope_, source))
        return warn

    undo = [_wrap(patch, handle_target, held_handle)]
    for target in once_targets:  # methods transformers adds to logging.Logger when it is imported
        if hasattr(logging.Logger, target.rpartition(".")[2]):
            undo.append(_wrap(patch, target, held_once))
    undo.append(_wrap(patch, warn_target, held_warn))
    return lambda: [u() for u in reversed(undo)]


@_declare(
    "children-run-first",
    targets=("multiprocessing.process:BaseProcess._bootstrap", "multiprocess.process:BaseProcess._bootstrap"),
    versions={"python": ">=3.10,<3.14", "multiprocess": ">=0.70,<0.71"},
    reason="""A process that ``multiprocessing`` (or ``multiprocess``, its fork, which datasets' process pools
    use) starts runs ``BaseProcess._bootstrap`` first, and neither library takes a hook there that every start
    method and pool honours: wrapped, each child started inside the block first calls ``first()``; data
    preparation asks there to be killed with the preparing process (``PR_SET_PDEATHSIG``,
    hybridlm/data/prepare.py), so a killed prepare leaves no orphaned tokenizer workers. ``multiprocess`` is
    patched where it is installed.""",
    applied_by=("hybridlm.data.prepare",),
    scoped=True)
def _children_run_first(patch: Patch, first: Callable[[], None]) -> Callable[[], None]:
    def run_first(original):
        def bootstrap(self, *args, **kwargs):
            first()
            return original(self, *args, **kwargs)
        return bootstrap

    undo = []
    for target in patch.targets:
        try:
            undo.append(_wrap(patch, target, run_first))
        except ModuleNotFoundError:  # multiprocess is not installed: nothing of it to patch
            continue
    return lambda: [u() for u in reversed(undo)]


@_declare(
    "vllm-hybrid-config",
    targets=("vllm.model_executor.models.config:MODELS_CONFIG_MAP",
             "vllm.transformers_utils.model_arch_config_convertor:MODEL_ARCH_CONFIG_CONVERTORS"),
    versions={"vllm": ">=0.32,<0.33"},
    reason="""vLLM finds an architecture's settings hook (a ``VerifyAndUpdateConfig``, run on the engine's config
    before any worker starts) in ``MODELS_CONFIG_MAP`` and how to read a model type's attention (a
    ``ModelArchConfigConvertorBase``, which turns its latent MLA cache on) in ``MODEL_ARCH_CONFIG_CONVERTORS``;
    neither map has a registration API, so the serving plugin (hybridlm/serve/plugin.py) adds the export's
    entries, leaving an entry already there (vLLM's own or a user's) as it is.""",
    applied_by=("hybridlm.serve.plugin",))
def _vllm_hybrid_config(patch: Patch, architecture: str, settings: type, model_type: str, convertor: type) -> None:
    for target, key, value in zip(patch.targets, (architecture, model_type), (settings, convertor)):
        owner, attr = _resolve(patch, target)
        getattr(owner, attr).setdefault(key, value)
