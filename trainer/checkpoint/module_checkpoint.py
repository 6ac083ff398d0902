"""``TrainingModule.load_from_checkpoint``: a module built from a checkpoint's hyperparameters, with
its weights, from a trainforge checkpoint directory or a Lightning ``.ckpt`` file.

- A trainforge directory is verified against its manifest, its weights read with safetensors and its
  hyperparameters from ``trainer_state.pt`` (``torch.load(weights_only=True)``), through
  ``strategies/checkpoint/io.py``. Hyperparameters that are not plain data were not stored
  (``trainer/module/hparams.py``): ``__init__`` arguments among them must be passed by name.
- A Lightning ``.ckpt`` is a pickle: it is read with ``torch.load(weights_only=True)`` only, which
  accepts tensors and plain data, plus Lightning's ``AttributeDict`` (read as a dict, without
  importing Lightning) and ``argparse.Namespace``. Anything else in it (a ``functools.partial`` or a
  module among the hyperparameters, or anything hostile) refuses the whole file, and nothing in it runs.

Then, as Lightning: saved hyperparameters updated with the keyword arguments become the ``__init__``
arguments (those ``__init__`` takes, unless it takes ``**kwargs``), ``configure_model()`` runs,
``on_load_checkpoint(checkpoint)`` may edit ``checkpoint["state_dict"]``, the weights are loaded
(``strict``) and the module is moved to the device of the loaded tensors.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
import zipfile
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from trainforge.strategies.checkpoint.frozen import RECORD, check_base, without_frozen
from trainforge.strategies.checkpoint.io import (
    load_object,
    load_tensors,
    read_metadata,
    refused_load,
    resolve_checkpoint,
)
from trainforge.strategies.checkpoint.remote import RemotePath, cache_dir, is_remote
from trainforge.strategies.checkpoint.remote_read import resolve_remote
from trainforge.strategies.errors import CheckpointError, ConfigurationError
from trainforge.trainer.checkpoint.adapters import base_model_name
from trainforge.trainer.module.hparams import HPARAMS_KEY, HPARAMS_NAME_KEY, NOT_STORED_KEY, AttributeDict

#: Where Lightning versions define the AttributeDict they pickle into .ckpt hyperparameters.
_ATTRIBUTE_DICT_NAMES = (
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
)
_PAST_HPARAMS_KEYS = ("hparams", "module_arguments")  # Lightning < 1.0 (its loader reads them too)
_LIGHTNING_ONLY = ("_instantiator", "_class_path")  # LightningCLI's: how it built the module
_REFUSED_WHY = (
    "a Lightning checkpoint needs only tensors and plain data, and trainforge also reads Lightning's "
    "AttributeDict and argparse.Namespace; an object among the hyperparameters (a module, a "
    "functools.partial) makes Lightning pickle code: leave it out with save_hyperparameters(ignore=[...]) "
    "in the program that writes the file"
)


class _PlainDict:
    """Lightning's ``AttributeDict`` while unpickling: builds a plain dict (which the weights-only
    unpickler fills), so Lightning need not be installed and no Lightning code runs."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return {}


@dataclass
class LoadedCheckpoint:
    path: Path
    checkpoint: Dict[str, Any]  # handed to on_load_checkpoint; its "state_dict" is what is loaded
    hparams: Dict[str, Any] = field(default_factory=dict)
    hparams_name: Optional[str] = None
    not_stored: Dict[str, str] = field(default_factory=dict)  # name -> type of what was left out
    has_hparams: bool = False
    frozen_base: Any = None  # a trainable-only checkpoint's record of its base (strategies/checkpoint/frozen.py)


def read_checkpoint(
    checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None, weights_only: Any = None
) -> LoadedCheckpoint:
    if weights_only is False:
        raise ConfigurationError(
            "load_from_checkpoint(weights_only=False): trainforge reads checkpoints without unpickling code "
            "(weights_only=True), always; leave the argument out"
        )
    if weights_only not in (None, True):
        raise ConfigurationError(f"load_from_checkpoint(weights_only={weights_only!r}): give True or leave it out")
    if not (map_location is None or isinstance(map_location, (str, torch.device, int, dict)) or callable(map_location)):
        raise ConfigurationError(
            f"load_from_checkpoint(map_location={map_location!r}): give a device ('cpu', 'cuda:0', torch.device), "
            "a dict of device renames or a function, as torch.load takes"
        )
    if is_remote(checkpoint_path):  # object storage: downloaded, verified (strategies/checkpoint/remote_read.py)
        url = RemotePath(str(checkpoint_path))
        checkpoint_path, _ = resolve_remote(url.parent, url, cache_dir(url.parent, f"pid{os.getpid()}"))
    try:
        path = Path(os.fspath(checkpoint_path))
    except TypeError:
        raise ConfigurationError(
            f"load_from_checkpoint({type(checkpoint_path).__name__}): give the path of a trainforge checkpoint "
            "directory or of a Lightning .ckpt file"
        ) from None
    if path.is_dir():
        loaded = _read_directory(path, map_location)
    elif path.is_file():
        loaded = _read_lightning(path, map_location)
    else:
        raise CheckpointError(
            f"{path}: no such checkpoint (give a trainforge checkpoint directory or a Lightning .ckpt file)"
        )
    if hparams_file is not None:
        loaded.hparams, loaded.has_hparams, loaded.not_stored = _read_hparams_file(hparams_file), True, {}
        loaded.hparams_name = None if loaded.hparams_name == "kwargs" else loaded.hparams_name
    return loaded


def _read_directory(path: Path, map_location: Any) -> LoadedCheckpoint:
    found = resolve_checkpoint(path.parent, path)  # verified against its manifest
    if isinstance(map_location, (dict,)) or (callable(map_location) and not isinstance(map_location, torch.device)):
        raise ConfigurationError(
            f"load_from_checkpoint({found}, map_location={map_location!r}): the weights of a trainforge checkpoint "
            "are read with safetensors, onto one device: give it ('cpu', 'cuda:0')"
        )
    device = torch.device("cpu" if map_location is None else map_location)
    weights = load_tensors(found, "model", device=str(device))
    try:
        state = load_object(found, "trainer_state")
    except CheckpointError:
        if (found / "trainer_state.pt").exists():
            raise
        state = {}  # save_weights_only: weights alone
    state = dict(state) if isinstance(state, dict) else {}
    hparams = state.get(HPARAMS_KEY)
    return LoadedCheckpoint(
        found,
        {**state, "state_dict": weights},
        hparams=dict(hparams) if isinstance(hparams, dict) else {},
        hparams_name=state.get(HPARAMS_NAME_KEY),
        not_stored=dict(state.get(NOT_STORED_KEY) or {}),
        has_hparams=isinstance(hparams, dict),
        frozen_base=load_object(found, RECORD) if read_metadata(found).get("trainable_only") else None,
    )


def _read_lightning(path: Path, map_location: Any) -> LoadedCheckpoint:
    allowed: List[Any] = [(_PlainDict, name) for name in _ATTRIBUTE_DICT_NAMES] + [Namespace]
    if map_location is None and not torch.cuda.is_available():
        map_location = "cpu"  # tensors saved on a GPU load on this machine too (Lightning)
    try:
        with torch.serialization.safe_globals(allowed):
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        if not zipfile.is_zipfile(path):  # not what torch.save writes: no unpickling story to tell
            raise CheckpointError(
                f"{path}: cannot be read as a Lightning checkpoint: it is not the zip file torch.save writes, or it "
                "is truncated"
            ) from None
        raise refused_load(path, e, _REFUSED_WHY) from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        keys = sorted(map(str, ckpt))[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(
            f"{path}: not a Lightning checkpoint (no 'state_dict' dict in it; it holds {keys}); "
            "load_from_checkpoint reads Lightning .ckpt files and trainforge checkpoint directories"
        )
    hparams: Dict[str, Any] = {}
    for key in (*_PAST_HPARAMS_KEYS, HPARAMS_KEY):
        if isinstance(ckpt.get(key), dict):
            hparams.update(ckpt[key])
    name = ckpt.get(HPARAMS_NAME_KEY)
    return LoadedCheckpoint(
        path,
        ckpt,
        hparams=hparams,
        hparams_name=name if isinstance(name, str) else None,
        has_hparams=HPARAMS_KEY in ckpt or any(k in ckpt for k in _PAST_HPARAMS_KEYS),
    )


def _read_hparams_file(hparams_file: Any) -> Dict[str, Any]:
    import yaml

    path = Path(os.fspath(hparams_file))
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigurationError(f"load_from_checkpoint(hparams_file={str(path)!r}): give a .yaml or .yml file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigurationError(f"load_from_checkpoint(hparams_file={str(path)!r}): cannot be read ({e})") from None
    if not isinstance(data, dict):
        raise ConfigurationError(
            f"load_from_checkpoint(hparams_file={str(path)!r}): holds a {type(data).__name__}, not a mapping of "
            "hyperparameters"
        )
    return data


def init_arguments(cls: type, loaded: LoadedCheckpoint, overrides: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments ``cls(...)`` is built with (Lightning's rule), or a ConfigurationError
    naming the arguments the checkpoint does not hold and the keyword arguments ``__init__`` does not take."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # type: ignore[misc]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    any_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    saved = {k: v for k, v in loaded.hparams.items() if k not in _LIGHTNING_ONLY}
    as_one = loaded.hparams_name if loaded.hparams_name in names else None  # __init__(self, hparams)
    if as_one is not None:
        inner = {k: v for k, v in overrides.items() if k not in names}
        kwargs = {as_one: AttributeDict({**saved, **inner}), **{k: v for k, v in overrides.items() if k in names}}
    else:
        unknown = [k for k in overrides if k not in names]
        if unknown and not any_kwargs:
            raise ConfigurationError(
                f"{cls.__name__}.load_from_checkpoint({', '.join(f'{k}=...' for k in unknown)}): "
                f"{cls.__name__}.__init__ takes no argument {', '.join(map(repr, unknown))} "
                f"(its arguments: {', '.join(names) or 'none'})"
            )
        kwargs = {**saved, **overrides}
        if not any_kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k in names}
    left_out = {k: t for k, t in loaded.not_stored.items() if (k in names or any_kwargs) and k not in overrides}
    if left_out and as_one is None:
        raise ConfigurationError(
            f"{loaded.path} does not hold the hyperparameter(s) {', '.join(f'{k} ({t})' for k, t in left_out.items())}: "
            "trainforge checkpoints store plain data only, so that loading one runs no code. Pass "
            f"{'it' if len(left_out) == 1 else 'them'}: {cls.__name__}.load_from_checkpoint(path, "
            f"{', '.join(f'{k}=...' for k in left_out)})"
        )
    required = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty]
    missing = [n for n in required if n not in kwargs]
    if missing:
        held = (
            "its hyperparameters do not include them"
            if loaded.has_hparams
            else "it holds no hyperparameters (the module did not call self.save_hyperparameters(), or the "
            "checkpoint holds weights only)"
        )
        raise ConfigurationError(
            f"{cls.__name__}.__init__ needs {', '.join(map(repr, missing))} and {loaded.path} cannot give "
            f"{'it' if len(missing) == 1 else 'them'}: {held}. Pass them: {cls.__name__}.load_from_checkpoint("
            f"path, {', '.join(f'{n}=...' for n in missing)})"
        )
    return kwargs


def load_weights(module: nn.Module, loaded: LoadedCheckpoint, strict: Any) -> None:
    """``checkpoint["state_dict"]`` into ``module`` (``strict``: every key on both sides), then the
    module moves to the device of the loaded tensors (Lightning)."""
    if strict is None:
        strict = True
    if not isinstance(strict, bool):
        raise ConfigurationError(f"load_from_checkpoint(strict={strict!r}): give True or False")
    weights = loaded.checkpoint.get("state_dict")
    if not isinstance(weights, dict):
        raise CheckpointError(
            f"{loaded.path}: checkpoint['state_dict'] is {type(weights).__name__} after on_load_checkpoint"
        )
    expected = module.state_dict()
    if loaded.frozen_base is not None:  # trainable-only: the module's own frozen base stays, if it is the one saved
        check_base(loaded.path, loaded.frozen_base, module, base_model_name(module))
        expected = without_frozen(expected, module)
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights
        and isinstance(v, torch.Tensor)
        and isinstance(weights[k], torch.Tensor)
        and tuple(weights[k].shape) != tuple(v.shape)
    ]
    if shapes or (strict and (missing or unexpected)):
        parts = [
            f"{what} {items[:3]}{' ...' if len(items) > 3 else ''}"
            for what, items in (("missing from the checkpoint:", missing), ("not in the module:", unexpected))
            if items and strict
        ]
        if shapes:
            parts.append(f"different shapes: {shapes[:3]}")
        hint = "" if shapes else "; strict=False loads the keys that match"
        raise CheckpointError(f"{loaded.path} does not fit {type(module).__name__} ({'; '.join(parts)}){hint}")
    for what, items in (
        ("in the module but not in the checkpoint", missing),
        ("in the checkpoint but not in the module", unexpected),
    ):
        if items:
            warnings.warn(f"load_from_checkpoint(strict=False): keys {what}: {items}", UserWarning, stacklevel=3)
    module.load_state_dict(weights, strict=strict and loaded.frozen_base is None)
    first = next((t for t in weights.values() if isinstance(t, torch.Tensor)), None)
    if first is None:
        warnings.warn(f"{loaded.path} holds no weights", UserWarning, stacklevel=3)
    else:
        module.to(first.device)


# lower case: used as a decorator, as classmethod is
class class_only:
    """A classmethod that refuses to be called on an instance (Lightning's): ``model.load_from_checkpoint(p)``
    without using its return value would leave ``model`` unchanged."""

    def __init__(self, method: Any) -> None:
        self.method = method

    def __get__(self, instance: Any, owner: type) -> Callable[..., Any]:
        bound: Callable[..., Any] = self.method.__get__(None, owner)
        if instance is None:
            return bound

        @functools.wraps(bound)
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise TypeError(
                f"{owner.__name__}.{bound.__name__} is a classmethod that returns a new module; it cannot be called "
                f"on an instance: model = {owner.__name__}.{bound.__name__}(path)"
            )

        return refused
