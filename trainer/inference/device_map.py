"""``infer_auto_device_map``: which device holds which module.

Placement units are modules walked in registration order; a unit too large for the device being
filled is split into its children (and its own direct tensors) unless its class is in
``no_split_module_classes``. A tie group is placed with its first unit: the modules holding the other
names are pulled onto the same device. Devices are filled in the order GPUs, ``"cpu"``, ``"disk"``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from trainforge.strategies.checkpoint.io import parse_size
from trainforge.strategies.errors import ConfigurationError, invalid_choice
from trainforge.strategies.meta import tie_groups

MODES = ("auto", "balanced", "balanced_low_0", "sequential")
Device = Union[int, str]


def _available_cpu() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**40


def normalize_device(dev: Device, what: str = "device") -> Device:
    """0 / "cuda:0" -> 0, "cpu", "disk"; a GPU that does not exist is an error."""
    if isinstance(dev, torch.device):
        dev = str(dev)
    if isinstance(dev, str) and dev.startswith("cuda"):
        dev = int(dev.split(":")[1]) if ":" in dev and dev.split(":")[1].isdigit() else (0 if dev == "cuda" else dev)
    if isinstance(dev, int) and not isinstance(dev, bool):
        n = torch.cuda.device_count()
        if not 0 <= dev < n:
            raise ConfigurationError(
                f"{what}={dev!r}: there is no GPU {dev} (this machine has {n} GPU(s)); use one "
                f"of {list(range(n)) + ['cpu', 'disk']}"
            )
        return dev
    if dev in ("cpu", "disk", "meta"):
        return dev
    raise invalid_choice(what, dev, ["a GPU index or 'cuda:i'", "'cpu'", "'disk'"])


def get_max_memory(max_memory: Optional[Dict[Device, Union[int, str]]] = None) -> Dict[Device, int]:
    """Byte budgets per device in placement order; missing ones default to 90% of what is free."""
    if max_memory is None:
        out: Dict[Device, int] = {}
        for i in range(torch.cuda.device_count()):
            out[i] = int(torch.cuda.mem_get_info(i)[0] * 0.9)
        out["cpu"] = int(_available_cpu() * 0.9)
        return out
    if not isinstance(max_memory, dict):
        raise ConfigurationError(f"max_memory={max_memory!r} is not a dict; give e.g. {{0: '10GiB', 'cpu': '30GiB'}}")
    parsed = {normalize_device(k, "max_memory key"): parse_size(v, f"max_memory[{k!r}]") for k, v in max_memory.items()}
    gpus = sorted(k for k in parsed if isinstance(k, int))
    return {**{g: parsed[g] for g in gpus}, **{k: parsed[k] for k in ("cpu", "disk") if k in parsed}}


def _nbytes(t: torch.Tensor, dtype: Optional[torch.dtype]) -> int:
    if dtype is not None and t.is_floating_point():
        return t.numel() * torch.empty(0, dtype=dtype).element_size()
    return t.numel() * t.element_size()


def _direct(module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]


def _tensors(model: nn.Module, prefix: str) -> List[Tuple[str, torch.Tensor]]:
    module = model.get_submodule(prefix)
    p = prefix + "." if prefix else ""
    return [(p + n, t) for n, t in module.named_parameters(remove_duplicate=False)] + [
        (p + n, t) for n, t in module.named_buffers(remove_duplicate=False)
    ]


def compute_module_sizes(model: nn.Module, dtype: Optional[torch.dtype] = None) -> Dict[str, int]:
    """Bytes of each module (and of "" for the model), each tensor counted once."""
    sizes: Dict[str, int] = {}
    for name, _ in model.named_modules(remove_duplicate=False):
        seen: Set[int] = set()
        total = 0
        for _, t in _tensors(model, name):
            if id(t) not in seen:
                seen.add(id(t))
                total += _nbytes(t, dtype)
        sizes[name] = total
    return sizes


def _balanced(model_size: int, unit_max: int, budgets: Dict[Device, int], low_0: bool) -> Dict[Device, int]:
    gpus = [d for d in budgets if isinstance(d, int)]
    if len(gpus) < 2:
        return budgets
    out = dict(budgets)
    share = model_size // (len(gpus) - 1 if low_0 else len(gpus)) + unit_max
    for i, g in enumerate(gpus):
        out[g] = min(budgets[g], unit_max if (low_0 and i == 0) else share)
    out[gpus[-1]] = budgets[gpus[-1]]  # the last GPU takes what does not fit evenly
    return out


def infer_auto_device_map(  # noqa: C901, PLR0915 - one greedy placement pass, Accelerate's algorithm
    model: nn.Module,
    max_memory: Optional[Dict[Device, Union[int, str]]] = None,
    no_split_module_classes: Optional[Sequence[str]] = None,
    dtype: Optional[torch.dtype] = None,
    mode: str = "auto",
) -> Dict[str, Device]:
    """``{module name: device}`` covering every parameter and buffer of ``model`` (which may be on meta)."""
    if mode not in MODES:
        raise invalid_choice(
            "mode", mode, MODES, "'auto' and 'balanced' spread over GPUs evenly, 'sequential' fills them in order"
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ConfigurationError(f"dtype={dtype!r} is not a torch.dtype; give e.g. torch.float16")
    if no_split_module_classes is None:
        no_split_module_classes = list(getattr(model, "_no_split_modules", None) or [])
    if isinstance(no_split_module_classes, str) or not all(isinstance(c, str) for c in no_split_module_classes):
        raise ConfigurationError(
            f"no_split_module_classes={no_split_module_classes!r} must be a list of class names such as ['GPT2Block']"
        )
    no_split = set(no_split_module_classes)
    sizes = compute_module_sizes(model, dtype)
    budgets = get_max_memory(max_memory)
    budgets.setdefault("disk", 2**62)  # as in Accelerate: what fits nowhere else goes to disk unless capped
    devices = list(budgets)
    if mode != "sequential":
        top = [n for n, _ in model.named_children()]
        unit_max = max([sizes[n] for n in top] + [0])
        budgets = _balanced(sizes[""], unit_max, budgets, mode == "balanced_low_0")
    # the tie partner of each tensor name: the module holding it must go where the first one went
    ties = tie_groups(model)
    tie_of = {n: g for g in ties for n in g}
    owner = lambda name: name.rpartition(".")[0]  # noqa: E731

    units: List[str] = [n for n, _ in model.named_children()]
    root_direct = [n for n, _ in _direct(model)]
    units = [f"{n}" for n in root_direct] + units  # direct tensors of the root are units of their own
    placed: Dict[str, Device] = {}
    placed_ids: Dict[Device, Set[int]] = {d: set() for d in devices}
    used = dict.fromkeys(devices, 0)
    d_i = 0

    def unit_tensors(u: str) -> List[Tuple[str, torch.Tensor]]:
        try:
            return _tensors(model, u)
        except AttributeError:  # a direct tensor of some module
            mod = model.get_submodule(owner(u))
            leaf = u.rpartition(".")[2]
            t = mod._parameters.get(leaf) if leaf in mod._parameters else mod._buffers[leaf]
            if t is None:  # units come from _direct, which skips None entries
                raise AttributeError(f"{u!r} is registered as None, not a tensor")
            return [(u, t)]

    def closure(u: str) -> List[str]:
        out = [u]
        for name, _ in unit_tensors(u):
            for other in tie_of.get(name, []):
                hold = next((x for x in units if other == x or other.startswith(x + ".")), None)
                if hold is not None and hold not in out:
                    out.append(hold)
        return out

    while units:
        u = units[0]
        group = closure(u)
        if d_i >= len(devices):
            biggest = max(((n, s) for n, s in sizes.items() if n), key=lambda x: x[1], default=("", 0))
            raise ConfigurationError(
                f"the model does not fit: {u!r} ({sizes.get(u, 0)} bytes) has no room left; "
                f"largest module {biggest[0]!r} is {biggest[1]} bytes; budgets "
                f"{ {d: budgets[d] for d in devices} }; raise max_memory or add 'disk'"
            )
        dev = devices[d_i]
        new = {id(t): _nbytes(t, dtype) for x in group for _, t in unit_tensors(x) if id(t) not in placed_ids[dev]}
        need = sum(new.values())
        if used[dev] + need <= budgets[dev]:
            for x in group:
                placed[x] = dev
                units.remove(x)
            placed_ids[dev].update(new)
            used[dev] += need
            continue
        try:
            mod = model.get_submodule(u)
        except AttributeError:
            mod = None
        children = list(mod.named_children()) if mod is not None else []
        if mod is not None and children and type(mod).__name__ not in no_split:
            units = [f"{u}.{n}" for n, _ in _direct(mod)] + [f"{u}.{n}" for n, _ in children] + units[1:]
            continue
        d_i += 1
    return _simplify(placed, model)


def _simplify(placed: Dict[str, Device], model: nn.Module) -> Dict[str, Device]:
    """Merge children all on one device into their parent (shorter maps, as Accelerate prints them)."""
    if placed and len(set(placed.values())) == 1:
        return {"": next(iter(placed.values()))}
    changed = True
    while changed:
        changed = False
        parents = {k.rpartition(".")[0] for k in placed if "." in k}
        for p in sorted(parents, key=lambda s: -s.count(".")):
            kids = [k for k in placed if k.rpartition(".")[0] == p]
            mod = model.get_submodule(p)
            expected = {f"{p}.{n}" for n, _ in mod.named_children()} | {f"{p}.{n}" for n, _ in _direct(mod)}
            if set(kids) == expected and len({placed[k] for k in kids}) == 1:
                dev = placed[kids[0]]
                for k in kids:
                    del placed[k]
                placed[p] = dev
                changed = True
    order = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}
    return dict(sorted(placed.items(), key=lambda kv: order.get(kv[0], order.get(kv[0].rpartition(".")[0], 0))))
