"""Models built without memory, given their memory where they train.

A model whose parameters are on the meta device (built inside ``Trainer.init_module(empty_init=True)``
/ ``Accelerator.init_module(empty_init=True)``, or under ``torch.device("meta")``) takes no host memory
until its strategy sets it up. FSDP2 shards it first and then materialises it, so each rank allocates
only its shard; single-device and DDP materialise it on the device before placement (every rank holds
the whole model there anyway). Each parameter then gets its values from, in order:

1. the pretrained weights ``load_pretrained(model, path)`` recorded on it (each rank reads only the
   slices it keeps: strategies/checkpoint/pretrained.py);
2. its module's own ``reset_parameters()`` (torch's layers have one; on a DTensor it fills the local
   shard, DTensor's random ops keeping the shards distinct);

and a parameter that gets neither stops the setup with an error naming it: uninitialised memory is
never trained. ``init_module`` keeps buffers real (rotary tables and masks are computed in
``__init__`` and no checkpoint holds them), so they are copied across ``to_empty``. Weight ties are
recorded before and restored after (``to_empty`` breaks them, strategies/meta.py).

With pretrained weights the result equals building the model whole and loading the same file
(tests/trainer/test_empty_init.py); with ``reset_parameters`` only, the values are a valid
initialisation but not the same random draws as an eager build.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, ContextManager, Dict, Iterator, Optional, Set, Tuple

import torch
from torch import nn

from trainforge.strategies.checkpoint.pretrained import (
    check_prefix_matches,
    load_slices,
    named_targets,
    warn_unused,
    weight_files,
)
from trainforge.strategies.errors import CheckpointError, ConfigurationError
from trainforge.strategies.meta import init_empty_weights, retie, shared_tensor_groups, tie_groups

log = logging.getLogger("trainforge")
PRETRAINED_ATTR = "_trainforge_pretrained"  # (path, prefix) recorded by load_pretrained on a meta model


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for _, t in named_targets(module))


@contextlib.contextmanager
def _empty_init_context(enabled: bool = True) -> Iterator[None]:
    """Parameters and persistent buffers created inside go to the meta device (non-persistent
    buffers stay real: they are computed, not loaded)."""
    if not enabled:
        yield
        return
    with init_empty_weights(include_buffers=False):
        try:
            yield
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            if "meta" not in str(exc):
                raise
            raise ConfigurationError(
                f"code inside init_module(empty_init=True) read the values of a tensor on the meta device ({exc}): "
                "parameters built there have shapes but no values until the strategy materialises them at setup. "
                "Initialise in the layer's reset_parameters() (run at setup) or give the weights with "
                "trainforge.load_pretrained(model, path); compute from values after prepare()/fit setup"
            ) from exc


def load_pretrained(module: nn.Module, path: Any, prefix: str = "") -> nn.Module:
    """Give ``module`` the weights in ``path`` (a .safetensors file, a transformers save_pretrained
    directory, a trainforge checkpoint directory). On a model built with ``empty_init`` the load is
    deferred to the strategy's setup, where each rank reads only the slices it keeps; otherwise it
    happens now (a DTensor-sharded model still reads only its slices). Every parameter must be in the
    file, except, on a deferred load, those whose module has ``reset_parameters()`` (named in a warning at
    setup); a prefix that matches none of them is an error either way, and tensors of the file under the
    prefix that the model has no use for are named in a warning now."""
    if not isinstance(module, nn.Module):
        raise ConfigurationError(f"load_pretrained(module={type(module).__name__}): give the nn.Module to load into")
    if not isinstance(prefix, str):
        raise ConfigurationError(f"load_pretrained(prefix={prefix!r}) must be a string such as 'model.'")
    weight_files(path)  # a wrong path fails here, not at setup
    # A prefix matching nothing fails here too, deferred or not; tensors nobody reads are named.
    check_prefix_matches(module, path, prefix)
    warn_unused(module, path, prefix)
    if has_meta(module):
        setattr(module, PRETRAINED_ATTR, (str(path), prefix))
        return module
    loaded = load_slices(module, path, prefix)
    missing = sorted(n for n, _ in named_targets(module) if n not in loaded)
    if missing:
        raise ConfigurationError(
            f"load_pretrained: {len(missing)} tensor(s) of the model are not in {path} under prefix {prefix!r}: "
            f"{missing[:5]}; check the prefix (the file's names are the model's names with it in front)"
        )
    return module


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s meta tensors on ``device`` (each rank its local shards) and fill them: the
    recorded pretrained weights, else the owning module's ``reset_parameters()``; error otherwise."""
    empty = {n for n, t in named_targets(module) if t.is_meta}
    if not empty:
        return
    _adopt_from_pretrained_origin(module, empty)
    # ties that hold now (FSDP2 keeps them; TP may have given a declared tie two shards)
    same_tensor = [group for group in shared_tensor_groups(module) if len(group) > 1]
    aliases = {n: [m for m in group if m != n] for group in tie_groups(module) for n in group}
    # to_empty replaces every tensor: the real ones (buffers, parts built eagerly) are put back
    real = {n: t.detach().clone() for n, t in _all_tensors(module) if not t.is_meta}
    module.to_empty(device=device)
    tensors = dict(_all_tensors(module))
    for name, value in real.items():
        _as_local(tensors[name]).copy_(value if not hasattr(value, "to_local") else value.to_local())
    retie(module, same_tensor)
    loaded: Set[str] = set()
    sources = []
    for mod_name, sub in module.named_modules():  # load_pretrained may have named a submodule
        recorded: Optional[Tuple[str, str]] = getattr(sub, PRETRAINED_ATTR, None)
        if recorded is None:
            continue
        pre = f"{mod_name}." if mod_name else ""
        mine = {n[len(pre) :] for n in empty if n.startswith(pre)}
        sub_aliases = {n[len(pre) :]: [m[len(pre) :] for m in ms if m.startswith(pre)] for n, ms in aliases.items()}
        loaded |= {pre + n for n in load_slices(sub, recorded[0], recorded[1], names=mine, aliases=sub_aliases)}
        sources.append(f"{recorded[0]} (prefix {recorded[1]!r})")
    _reset_the_rest(module, empty - loaded, loaded, sources)


def _adopt_from_pretrained_origin(module: nn.Module, empty: Set[str]) -> None:
    """A transformers model loaded with ``from_pretrained`` inside ``init_module(empty_init=True)`` had
    its weights dropped on the meta device (they were registered there like any new parameter).
    Re-initialising it would train from random weights, silently: its files are read instead when
    ``config._name_or_path`` is a local directory of safetensors, else the setup stops and says how."""
    covered: list = []
    for mod_name, sub in module.named_modules():
        pre = f"{mod_name}." if mod_name else ""
        origin = getattr(getattr(sub, "config", None), "_name_or_path", "")
        if getattr(sub, PRETRAINED_ATTR, None) is not None:
            covered.append(pre)
        if not origin or any(pre.startswith(c) for c in covered) or not any(n.startswith(pre) for n in empty):
            continue
        try:
            weight_files(origin)
        except CheckpointError as exc:
            raise ConfigurationError(
                f"{type(sub).__name__} ({mod_name or 'the model'}) was loaded with from_pretrained({origin!r}) inside "
                "init_module(empty_init=True): its weights were dropped on the meta device, and that name is not a "
                f"local directory of safetensors to read them back from ({exc}). Build it there from its config "
                "(from_config) and call trainforge.load_pretrained(model, <directory of its safetensors>), or load "
                "it outside init_module"
            ) from None
        log.info("trainforge: %s came from from_pretrained(%r): its weights are read from there", mod_name, origin)
        setattr(sub, PRETRAINED_ATTR, (str(origin), ""))
        covered.append(pre)


def _reset_the_rest(module: nn.Module, left: Set[str], loaded: Set[str], sources: list) -> None:
    reset = []
    for mod_name, mod in module.named_modules():
        own = {f"{mod_name}.{leaf}" if mod_name else leaf: leaf for leaf in (*mod._parameters, *mod._buffers)}
        mine = left & set(own)
        if not mine or not callable(getattr(mod, "reset_parameters", None)):
            continue
        reset += sorted(mine)
        keep: Dict[str, torch.Tensor] = {n: _local(mod, own[n]).clone() for n in set(own) & loaded}
        mod.reset_parameters()  # resets all of its tensors: the pretrained ones are put back
        for name, value in keep.items():
            _local(mod, own[name]).copy_(value)
        left -= mine
    if sources and reset:
        # transformers says the same of weights "newly initialized": a partial load is never silent
        more = f" and {len(reset) - 10} more" if len(reset) > 10 else ""
        warnings.warn(
            f"{len(reset)} tensor(s) are not in {', '.join(sources)} and were initialised by their module's "
            f"reset_parameters() instead: {reset[:10]}{more}",
            UserWarning,
            stacklevel=2,
        )
    if left:
        where = f"not in {', '.join(sources)} and " if sources else ""
        raise ConfigurationError(
            f"{len(left)} parameter(s) built on the meta device are {where}owned by a module without "
            f"reset_parameters(): {sorted(left)[:5]}. Load weights that hold them "
            "(trainforge.load_pretrained(model, path)), give that module a reset_parameters() that "
            "initialises its own tensors, or build the model without empty_init"
        )


def _local(mod: nn.Module, leaf: str) -> torch.Tensor:
    tensor = mod._parameters[leaf] if leaf in mod._parameters else mod._buffers[leaf]
    assert tensor is not None
    return _as_local(tensor)


def _as_local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: this rank's shard
    return to_local() if to_local is not None else tensor


def _all_tensors(module: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def materialize_whole(module: nn.Module, device: torch.device, strategy: str) -> None:
    """For the strategies that do not shard before materialising (DeepSpeed: zero.Init is not used;
    pipeline parallelism; XLA): the model is materialised whole on ``device`` first, so the script runs
    unchanged under them, without the memory saving (said once in the log)."""
    if has_meta(module):
        log.info(
            "trainforge: strategy=%r materialises the meta model whole before sharding it: each rank holds the "
            "whole model during setup (FSDP and tensor parallelism hold only their shards)",
            strategy,
        )
        materialize(module, device)


def init_module_context(strategy: Any, empty_init: Optional[bool]) -> ContextManager[None]:
    """``Trainer.init_module`` / ``Accelerator.init_module``: ``empty_init`` True builds on the meta
    device, False as usual, None as the strategy prefers (FSDP: empty, it materialises shard by shard)."""
    if empty_init is not None and not isinstance(empty_init, bool):
        raise ConfigurationError(f"init_module(empty_init={empty_init!r}) must be None, True or False")
    wanted = strategy.empty_init_default if empty_init is None else empty_init
    return _empty_init_context(wanted)
