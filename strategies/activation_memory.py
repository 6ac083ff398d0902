"""Activation memory controls, one argument for every strategy: ``activation_checkpointing=``.

Values (the same for ``SingleDeviceStrategy``, ``DDPStrategy``, ``FSDPStrategy``, ``DeepSpeedStrategy``
and ``MegatronStrategy``)::

    None / False / "none"       off
    "full" / True               every block recomputed in backward (torch.utils.checkpoint, non-reentrant)
    "selective:2"               every 2nd block (the 2nd, 4th, ...) recomputed; {"mode": "selective", "every": 2}
    "op" / "selective:op"       every block, op level: matmul and attention outputs kept, the rest recomputed
                                (create_selective_checkpoint_contexts)
    "offload"                   every block's saved activations moved to host memory (torch's save_on_cpu,
                                pinned on CUDA) and brought back in backward; nothing recomputed
    {"mode": m, "every": n, "blocks": policy}   any mode on every n-th block of a chosen set
    a set of module classes / class names, or a callable (module, name) -> bool: "full" on those modules

Blocks are what ``fsdp_wrap.select_modules`` finds: by default the repeated blocks of the model
(``repeated_blocks``; FSDP: its wrapped units), else the ``blocks`` policy. Each chosen block is
replaced in its parent by torch's ``checkpoint_wrapper`` (state-dict keys unchanged, so checkpoints
load across modes). Every mode leaves the numbers alone: recomputation replays the same kernels
with the same RNG state, and offloading copies tensors bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.fsdp_wrap import CHECKPOINT_PREFIX, select_modules

log = logging.getLogger("trainforge")

#: What a strategy can apply, declared on ``Strategy.activation_checkpointing_modes``.
MODES = ("full", "selective", "op", "offload")
VALID = (
    "None/False (off), 'full' (every block; True is the same), 'selective:<n>' or "
    "{'mode': 'selective', 'every': <n>} (every n-th block), 'op' (matmul and attention outputs kept, "
    "the rest recomputed), 'offload' (saved activations in host memory), {'mode': ..., 'every': <n>, "
    "'blocks': {BlockClass}}, or a set of module classes / a callable (module, name) -> bool ('full' on those)"
)
_OFF = (None, False, "none", "off")
APPLIED = "_trainforge_activation_memory"  # set on the wrappers made here: a second setup leaves the model alone


@dataclass(frozen=True)
class ActivationMemory:
    """A parsed ``activation_checkpointing`` value. ``kind``: None (off), "full", "op" or "offload";
    ``every``: every n-th chosen block; ``blocks``: a ``select_modules`` policy, None for the strategy's."""

    kind: Optional[str] = None
    every: int = 1
    blocks: Any = None
    given: Any = field(default=None, compare=False)

    @property
    def enabled(self) -> bool:
        return self.kind is not None

    @property
    def mode(self) -> Optional[str]:
        """The user's name of the mode: "selective" for "full" on every n-th block."""
        return "selective" if self.kind == "full" and self.every > 1 else self.kind

    @property
    def recomputes_every_block(self) -> bool:
        """Each block keeps only its input (what Megatron's layout estimate assumes)."""
        return self.kind == "full" and self.every == 1


def _bad(value: Any, why: str) -> ConfigurationError:
    return ConfigurationError(f"activation_checkpointing={value!r} {why}")


def _every(value: Any, every: Any) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise _bad(
            value,
            f"has every={every!r}; every must be an int >= 1 (1: every block, 2: every second block), "
            "e.g. 'selective:2' or {'mode': 'selective', 'every': 2}",
        )
    return every


def _from_name(value: Any, name: str, every: Any = None, blocks: Any = None) -> ActivationMemory:
    key = name.strip().lower()
    if key.startswith("selective:"):
        option = key.split(":", 1)[1].strip()
        if option == "op":
            key = "op"
        elif option.lstrip("-").isdigit():
            key, every = "selective", int(option)
        else:
            raise _bad(value, f"has {option!r} after 'selective:'; give a block interval such as 'selective:2' or 'op'")
    if key in _OFF:
        return ActivationMemory(given=value)
    if key not in MODES:
        raise _bad(value, f"is not one of: {VALID}")
    if key == "selective" and every is None:
        raise _bad(value, "needs an interval: 'selective:2' checkpoints every second block ('full' is every block)")
    kind = "full" if key == "selective" else key
    every = _every(value, 1 if every is None else every)
    return ActivationMemory(kind=kind, every=every, blocks=blocks, given=value)


def _blocks(value: Any, blocks: Any) -> Any:
    entries = list(blocks) if isinstance(blocks, (set, frozenset, list, tuple)) else None
    if blocks is None or (entries is None and callable(blocks)):
        return blocks
    if not entries or not all(isinstance(e, (type, str)) for e in entries):
        raise _bad(
            value,
            f"has blocks={blocks!r}; give a non-empty set of module classes or class names ({{'GPT2Block'}}), "
            "a callable (module, name) -> bool, or None for the repeated blocks",
        )
    return blocks


def parse_activation_checkpointing(value: Any) -> ActivationMemory:
    """The ``ActivationMemory`` for a user's value; ConfigurationError naming it and the valid ones."""
    if isinstance(value, ActivationMemory):
        return value
    if value is None or value is False:
        return ActivationMemory(given=value)
    if value is True:
        return ActivationMemory(kind="full", given=value)
    if isinstance(value, str):
        return _from_name(value, value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"mode", "every", "blocks"})
        if unknown or "mode" not in value or not isinstance(value["mode"], str):
            raise _bad(value, f"must be a dict with a 'mode' (and optionally 'every', 'blocks'); valid: {VALID}")
        return _from_name(value, value["mode"], value.get("every"), _blocks(value, value.get("blocks")))
    if isinstance(value, (set, frozenset, list, tuple)) or callable(value):
        return ActivationMemory(kind="full", blocks=_blocks(value, value), given=value)
    raise _bad(value, f"is not one of: {VALID}")


def check_supported(spec: ActivationMemory, strategy: str, modes: Sequence[str], why: str = "") -> None:
    """ConfigurationError, before anything runs, when ``strategy`` cannot apply the mode asked for."""
    if spec.enabled and spec.mode not in modes:
        fix = (
            f"Modes it applies: {', '.join(repr(m) for m in modes)}; pass one of those, or activation_checkpointing=None"
            if modes
            else "It applies none: pass activation_checkpointing=None"
        )
        raise ConfigurationError(
            f"activation_checkpointing={spec.given!r} ({spec.mode!r}) is not available with "
            f"strategy={strategy!r}{': ' + why if why else ''}. {fix}"
        )


def check_offload_layout(spec: ActivationMemory, tensor_parallel_size: int) -> None:
    """ "offload" copies saved tensors as plain tensors; tensor parallelism saves DTensors."""
    if spec.kind == "offload" and tensor_parallel_size > 1:
        raise ConfigurationError(
            f"activation_checkpointing={spec.given!r} cannot be used with tensor_parallel_size="
            f"{tensor_parallel_size}: the blocks then save DTensors for backward, which torch's save_on_cpu "
            "copies as plain tensors. Use 'full', 'selective:<n>' or 'op' with tensor parallelism"
        )


def select_blocks(model: nn.Module, spec: ActivationMemory, default_blocks: Any = None) -> List[str]:
    """Names of the blocks ``spec`` applies to, in model order: the outermost modules the policy picks
    (``spec.blocks``, else ``default_blocks``, else the repeated blocks), then every n-th of them.
    Blocks already wrapped (a second ``setup``) count as found and are left alone."""
    if not spec.enabled or any(hasattr(m, APPLIED) for m in model.modules()):
        return []  # off, or applied by an earlier setup of this model
    policy = spec.blocks if spec.blocks is not None else default_blocks
    picked = {name for name, _ in select_modules(model, policy)}
    ordered = [name for name, _ in model.named_modules() if name in picked]
    outer = [n for n in ordered if not any(n.startswith(o + ".") for o in ordered if o != n)]
    blocks = [n for n in outer if CHECKPOINT_PREFIX.rstrip(".") not in n.split(".")]
    if not blocks and not any(isinstance(model.get_submodule(n), _wrapper_types()) for n in outer):
        raise _bad(
            spec.given,
            f"finds no block in {type(model).__name__}: it looks for repeated blocks (a ModuleList or "
            "Sequential of >= 2 children of one class, with parameters); name yours with "
            "{'mode': 'full', 'blocks': {MyBlock}}",
        )
    chosen = [n for i, n in enumerate(blocks) if (i + 1) % spec.every == 0]
    if blocks and not chosen:
        raise _bad(
            spec.given,
            f"has every={spec.every} but {type(model).__name__} has {len(blocks)} block(s): nothing would be "
            f"checkpointed; choose every <= {len(blocks)}",
        )
    return [n for n in chosen if not isinstance(model.get_submodule(n), _wrapper_types())]


def _wrapper_types() -> Tuple[type, ...]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    return (ActivationWrapper,)


def apply_activation_memory(model: nn.Module, spec: ActivationMemory, names: Sequence[str]) -> Dict[int, nn.Module]:
    """Replace each named block (absent ones, e.g. pruned pipeline stages, are skipped) by torch's
    ``checkpoint_wrapper`` doing ``spec.kind``. Returns ``{id(original block): wrapper}``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if not spec.enabled:
        return {}
    kwargs: Dict[str, Any] = {}
    if spec.kind == "op":
        kwargs["context_fn"] = op_level_contexts
    elif spec.kind == "offload":
        kwargs["checkpoint_fn"] = run_offloaded
    present = dict(model.named_modules())
    wrappers: Dict[int, nn.Module] = {}
    for name in names:
        if name not in present:
            continue
        module = present[name]
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapper = checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
        setattr(wrapper, APPLIED, spec.kind)
        setattr(parent, child, wrapper)
        wrappers[id(module)] = wrapper
    return wrappers


# ---- op level: which outputs a recomputed block keeps ---------------------------------------------
def _saved_ops() -> Set[Any]:
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_mm",
    )
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


SAVED_OPS = _saved_ops()


def keep_matmul_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The "op" policy: matmul and fused-attention outputs are saved, everything else (norms,
    activations, elementwise ops, views) is recomputed from them in backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _guarded_policy() -> Callable[..., Any]:
    """``keep_matmul_outputs`` for one block's forward, refusing an in-place op on an output it keeps:
    torch's selective checkpoint would hand the modified tensor to the recomputation and give wrong
    gradients without a word (seen with ``y = x @ w.t(); y += b`` on torch 2.13; its own version check
    does not catch it). Needs the op's output in the policy's context (torch 2.13 gives it); without it, unguarded."""
    kept: Set[int] = set()  # data pointers of the kept outputs' storages (alive until backward)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if not ctx.is_recompute:
            if kept and op._schema.is_mutable:
                for arg, value in zip(op._schema.arguments, args):
                    if arg.alias_info is not None and arg.alias_info.is_write and _storage_ptr(value) in kept:
                        raise ConfigurationError(
                            f"activation_checkpointing='op': {op} modifies in place the output of a matmul "
                            "that the op-level mode keeps for backward, which would make torch recompute "
                            "wrong gradients. Write that operation out of place (y = y + b instead of "
                            "y += b), or use 'full' or 'selective:<n>'"
                        )
            if op in SAVED_OPS:
                ptr = _storage_ptr(getattr(ctx, "op_output", None))
                if ptr is not None:
                    kept.add(ptr)
        return keep_matmul_outputs(ctx, op, *args, **kwargs)

    return policy


def _storage_ptr(value: Any) -> Optional[int]:
    if type(value) is not torch.Tensor:  # plain tensors only (a DTensor's storage is its local shard's)
        return None
    return value.untyped_storage().data_ptr()


def op_level_contexts() -> Tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` for "op": torch's selective checkpoint contexts with
    ``keep_matmul_outputs``; under ``measure_saved_bytes`` the outputs it keeps are counted too (they
    are cached by torch's dispatch mode, not saved through autograd's hooks)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    forward, recompute = create_selective_checkpoint_contexts(_guarded_policy())
    meter = _METER.get()
    return (forward if meter is None else _counted(forward, meter)), recompute


@contextlib.contextmanager
def _counted(forward: Any, meter: SavedBytes) -> Iterator[None]:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class CountKept(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))  # through the caching mode below, which keeps it
            if func in SAVED_OPS:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        meter.count(t, "device")
            return out

    with forward, CountKept():
        yield


# ---- offload: saved tensors to host memory ---------------------------------------------------------
def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, nn.Parameter)


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """torch's ``save_on_cpu`` for activations only: parameters (and views of them) saved for backward
    stay where they are (they live on anyway; copying them would double the traffic), tensors already in
    host memory are kept as they are, the rest go through ``save_on_cpu``'s pack/unpack."""

    def __init__(self, device_type: str) -> None:
        pin = device_type == "cuda" and torch.cuda.is_available()
        inner = torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=device_type)

        def pack(tensor: torch.Tensor) -> Tuple[bool, Any]:
            moved = tensor.device.type != "cpu" and not _is_parameter(tensor)
            meter = _METER.get()
            if meter is not None:
                meter.count(tensor, "host" if moved else "device")
            return (True, inner.pack_hook(tensor)) if moved else (False, tensor)

        def unpack(packed: Tuple[bool, Any]) -> torch.Tensor:
            moved, value = packed
            return inner.unpack_hook(value) if moved else value

        super().__init__(pack, unpack)


def run_offloaded(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``checkpoint_wrapper``'s function for "offload": the block's forward under ``HostOffload``."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    with HostOffload(device.type):
        return module(*args, **kwargs)


# ---- measuring: bytes kept for backward ------------------------------------------------------------
@dataclass
class SavedBytes:
    """Storage bytes autograd keeps for backward between a forward and its backward: ``device``
    (left in the compute device's memory; on a CPU run all of them) and ``host`` (moved to host memory
    by "offload"). Parameters are not counted; a storage shared by several saved views counts once."""

    device: int = 0
    host: int = 0
    _seen: Dict[Tuple[str, int], Any] = field(default_factory=dict, repr=False)

    def count(self, tensor: torch.Tensor, where: str) -> None:
        if _is_parameter(tensor) or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in self._seen:
            return
        self._seen[key] = storage  # held until the meter closes, so that no address is reused meanwhile
        setattr(self, where, getattr(self, where) + storage.nbytes())


_METER: contextvars.ContextVar[Optional[SavedBytes]] = contextvars.ContextVar("trainforge_saved_bytes", default=None)


@contextlib.contextmanager
def measure_saved_bytes() -> Iterator[SavedBytes]:
    """Count what the forward inside saves for backward (``torch.autograd.graph.saved_tensors_hooks``);
    "offload" blocks report what they keep and what they move. Wrap the forward only, not the backward."""
    meter = SavedBytes()
    token = _METER.set(meter)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        meter.count(tensor, "device")
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
            yield meter
    finally:
        _METER.reset(token)
        meter._seen.clear()


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def describe(spec: ActivationMemory, names: Sequence[str]) -> str:
    """One log line's worth: the mode and how many blocks it applies to."""
    every = f" (every {spec.every})" if spec.every > 1 else ""
    return f"activation_checkpointing {spec.mode}{every} on {len(names)} block(s)"


__all__ = [
    "MODES",
    "ActivationMemory",
    "HostOffload",
    "SavedBytes",
    "apply_activation_memory",
    "check_supported",
    "keep_matmul_outputs",
    "measure_saved_bytes",
    "parse_activation_checkpointing",
    "select_blocks",
]
