"""Hyperparameters of a ``TrainingModule`` or ``DataModule``, with Lightning's meaning.

``self.save_hyperparameters()`` in ``__init__`` records the ``__init__`` arguments (of every
``__init__`` of the object on the stack: a subclass's values win) in ``self.hparams``, an
:class:`AttributeDict` (``self.hparams.lr`` is ``self.hparams["lr"]``). Also as Lightning:
``save_hyperparameters("lr", "hidden")`` (those only), ``save_hyperparameters(a_dict_or_namespace)``,
``ignore="net"`` or ``ignore=[...]``, ``logger=False`` (not sent to the trackers as params).
trainforge adds ``**values`` (recorded as given).

Trainer checkpoints store them in ``trainer_state.pt`` (:func:`checkpoint_hparams`), which is read
with ``torch.load(weights_only=True)``: plain data only (numbers, strings, None, tensors, dtypes,
lists, tuples and dicts of them). A value that is not (an ``nn.Module``, a ``functools.partial``, an
object) is left out and its name recorded, so ``load_from_checkpoint`` can ask for it by name.
"""

from __future__ import annotations

import copy
import inspect
import types
import warnings
from argparse import Namespace
from collections.abc import Mapping, MutableMapping
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError

#: trainer_state.pt keys (Lightning's .ckpt uses the first two names too)
HPARAMS_KEY, HPARAMS_NAME_KEY, NOT_STORED_KEY = "hyper_parameters", "hparams_name", "hyper_parameters_not_stored"
DATAMODULE_PREFIX = "datamodule_"


class AttributeDict(Dict[str, Any]):
    """A dict whose keys are also attributes (Lightning's ``AttributeDict``): ``hp.lr`` is ``hp["lr"]``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"no hyperparameter {key!r} (saved: {', '.join(map(str, self)) or 'none'})") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError:
            raise AttributeError(key) from None


class HyperparametersMixin:
    """``save_hyperparameters``, ``hparams_initial``; the host provides ``hparams`` (read and write)."""

    hparams: Any

    def save_hyperparameters(  # noqa: C901 - Lightning's accepted call forms, one branch each
        self,
        *args: Any,
        ignore: Optional[Any] = None,
        frame: Optional[types.FrameType] = None,
        logger: bool = True,
        **values: Any,
    ) -> None:
        """Record hyperparameters in ``self.hparams`` (see this module's docstring)."""
        if not isinstance(logger, bool):
            raise ConfigurationError(f"save_hyperparameters(logger={logger!r}): give True or False")
        ignored = _ignore_list(ignore)
        one_container = (
            len(args) == 1 and not isinstance(args[0], str) and isinstance(args[0], (Mapping, list, tuple, Namespace))
        )
        if one_container and not (vars(args[0]) if isinstance(args[0], Namespace) else args[0]) and not values:
            # an empty container: nothing to record (Lightning)
            return
        if frame is None:
            caller = inspect.currentframe()
            frame = caller.f_back if caller is not None else None
        init_args = _init_arguments(self, frame)
        owner = type(self).__name__
        for key in ignored:
            if key not in init_args and not (isinstance(self.hparams, Mapping) and key in self.hparams):
                warnings.warn(
                    f"save_hyperparameters(ignore=[{key!r}]): {owner}.__init__ has no argument {key!r} "
                    f"(its arguments: {', '.join(init_args) or 'none'}); nothing is ignored for it",
                    UserWarning,
                    stacklevel=2,
                )
        init_args = {k: v for k, v in init_args.items() if k not in ignored}
        objects = [a for a in args if not isinstance(a, str)]
        names = [a for a in args if isinstance(a, str)]
        hp: Any
        name: Optional[str]
        if len(objects) > 1 or (objects and names):
            raise ConfigurationError(
                f"save_hyperparameters({', '.join(type(a).__name__ for a in args)}): give either names of "
                f"{owner}.__init__ arguments or one dict/Namespace, not both or several"
            )
        if objects:
            hp = _as_hparams(objects[0])
            same = [k for k, v in init_args.items() if v is objects[0]]
            name = same[0] if same else None
        elif names:
            unknown = [n for n in names if n not in init_args]
            if unknown:
                raise ConfigurationError(
                    f"save_hyperparameters({', '.join(map(repr, names))}): {', '.join(map(repr, unknown))} "
                    f"{'is not an argument' if len(unknown) == 1 else 'are not arguments'} of {owner}.__init__ "
                    f"(its arguments: {', '.join(init_args) or 'none'}{', ignored: ' + ', '.join(ignored) if ignored else ''})"
                )
            hp, name = AttributeDict({n: init_args[n] for n in names}), "kwargs"
        else:
            hp, name = AttributeDict(init_args), "kwargs" if init_args else None
        if isinstance(hp, dict) and isinstance(self.hparams, dict):
            self.hparams.update(hp)
        else:
            self.hparams = hp
        if values:
            if not isinstance(self.hparams, MutableMapping):
                raise ConfigurationError(f"save_hyperparameters(**values) with hparams of type {type(hp).__name__}")
            self.hparams.update(values)
        if isinstance(self.hparams, MutableMapping):
            for key in ignored:
                self.hparams.pop(key, None)
            for key, value in self.hparams.items():
                if isinstance(value, nn.Module):
                    warnings.warn(
                        f"hyperparameter {key!r} of {owner} is an nn.Module: its weights are in the checkpoint already "
                        "and the module itself is not stored there; ignore it with "
                        f"self.save_hyperparameters(ignore=[{key!r}]) and pass it to "
                        f"load_from_checkpoint(path, {key}=...)",
                        UserWarning,
                        stacklevel=2,
                    )
        state = vars(self)
        state["_hparams_name"], state["_log_hyperparams"] = name, logger
        state["_hparams_initial"] = _copy(self.hparams)

    @property
    def hparams_initial(self) -> AttributeDict:
        """The hyperparameters as ``save_hyperparameters`` recorded them (a copy: later changes to
        ``self.hparams`` are not in it). What the trackers receive."""
        initial = vars(self).get("_hparams_initial")
        if initial is None:
            return AttributeDict()
        return AttributeDict(_copy(dict(initial) if isinstance(initial, Mapping) else vars(initial)))


def _ignore_list(ignore: Any) -> List[str]:
    if ignore is None:
        return []
    if isinstance(ignore, str):
        return [ignore]
    if isinstance(ignore, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in ignore):
        return sorted(set(ignore))
    raise ConfigurationError(
        f"save_hyperparameters(ignore={ignore!r}): give an argument name or a list of argument names"
    )


def _as_hparams(hp: Any) -> Any:
    if isinstance(hp, Namespace):
        hp = vars(hp)
    if isinstance(hp, dict):
        return AttributeDict(hp)
    if isinstance(hp, MutableMapping):  # e.g. OmegaConf's DictConfig: kept as it is (Lightning)
        return hp
    hint = " (dataclasses.asdict(cfg) makes one)" if hasattr(type(hp), "__dataclass_fields__") else ""
    raise ConfigurationError(
        f"save_hyperparameters({type(hp).__name__}): give names of __init__ arguments, a dict or an "
        f"argparse.Namespace{hint}"
    )


def _init_arguments(obj: Any, frame: Optional[types.FrameType]) -> Dict[str, Any]:
    """The arguments of the ``__init__`` calls of ``obj`` on the stack, from ``frame`` outward: the
    caller's ``__init__``, then each subclass ``__init__`` that called it through ``super()``. The
    outer (more specific) call's value wins; ``*args`` is left out, ``**kwargs`` is spread."""
    found: List[Dict[str, Any]] = []
    while frame is not None:
        args = _arguments_of_init(obj, frame)
        if args is None and found:
            break
        if args is not None:
            found.append(args)
        frame = frame.f_back
    out: Dict[str, Any] = {}
    for args in found:
        out.update(args)
    return out


def _arguments_of_init(obj: Any, frame: types.FrameType) -> Optional[Dict[str, Any]]:
    if frame.f_code.co_name != "__init__":
        return None
    info = inspect.getargvalues(frame)
    if not info.args or info.locals.get(info.args[0]) is not obj:
        return None  # the __init__ of another object (a module built inside this one's __init__)
    out = {name: info.locals[name] for name in info.args[1:] if name in info.locals}
    if info.keywords and isinstance(info.locals.get(info.keywords), dict):
        out.update(info.locals[info.keywords])
    return out


def _copy(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # an object that cannot be deep-copied (a lock, a file): the same object
        return copy.copy(value)


# ---- checkpoints ---------------------------------------------------------------------------------
_LEAVES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _plain(value: Any) -> Tuple[bool, Any]:
    """``(True, copy)`` when ``value`` survives ``torch.load(weights_only=True)`` as the same data."""
    if isinstance(value, _LEAVES) and type(value) in _LEAVES:
        return True, value
    if type(value) is torch.Tensor:
        return True, value.detach().cpu()
    if isinstance(value, Mapping) and all(type(k) in (str, int) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return all(ok for ok, _ in items.values()), {k: v for k, (_, v) in items.items()}
    if type(value) in (list, tuple):
        parts = [_plain(v) for v in value]
        return all(ok for ok, _ in parts), type(value)(v for _, v in parts)
    return False, None


def checkpoint_hparams(obj: Any, prefix: str = "") -> Dict[str, Any]:
    """The entries of a Trainer checkpoint's state for ``obj``'s hyperparameters: the plain ones, the
    name of the ``__init__`` argument they came in as (one dict), and the names (with their types) of
    those that cannot be stored as plain data."""
    hp = obj.hparams if obj is not None else None
    if not hp:
        return {}
    items = dict(hp) if isinstance(hp, Mapping) else vars(hp)
    stored, not_stored = {}, {}
    for key, value in items.items():
        ok, plain = _plain(value)
        if ok and type(key) is str:
            stored[key] = plain
        else:
            not_stored[str(key)] = f"{type(value).__module__}.{type(value).__qualname__}"
    return {
        prefix + HPARAMS_KEY: stored,
        prefix + HPARAMS_NAME_KEY: vars(obj).get("_hparams_name"),
        prefix + NOT_STORED_KEY: not_stored,
    }


def logged_hparams(*objects: Any) -> Dict[str, Any]:
    """What the trackers receive as params: each object's ``hparams_initial`` unless it saved them with
    ``logger=False``; the same key with different values in two of them is an error (Lightning)."""
    out: Dict[str, Any] = {}
    owners: Dict[str, str] = {}
    for obj in objects:
        if not isinstance(obj, HyperparametersMixin) or not vars(obj).get("_log_hyperparams", True):
            continue
        for key, value in obj.hparams_initial.items():
            if key in out and not _same(out[key], value):
                raise ConfigurationError(
                    f"hyperparameter {key!r} is {out[key]!r} in {owners[key]} and {value!r} in "
                    f"{type(obj).__name__}, and both are logged: rename one, or save one with "
                    "save_hyperparameters(logger=False)"
                )
            out[key], owners[key] = value, type(obj).__name__
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # tensors with several values, objects whose == raises
        return False
