"""Putting a model's weights where a device map says, without copies for CPU and disk.

``load_checkpoint_and_dispatch`` memory-maps the checkpoint one shard at a time: weights mapped to a
GPU are copied there, weights mapped to ``"cpu"`` or ``"disk"`` stay views of the file (file-backed
pages, zero copy). A safetensors source is never re-written; ``.bin`` shards and in-memory weights
sent to disk are written once as safetensors in the offload folder and mapped from there.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from trainforge.strategies.checkpoint.safetensors_mmap import MappedFile, mmap_safetensors
from trainforge.strategies.errors import CheckpointError, ConfigurationError
from trainforge.strategies.meta import retie, set_tensor, tie_groups
from trainforge.trainer.inference.device_map import MODES, Device, infer_auto_device_map, normalize_device
from trainforge.trainer.inference.offload_hooks import Runner, first_device, send_to
from trainforge.trainer.inference.sources import Source, check_writable, open_source, write_offload


def _all_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def resolve_map(model: nn.Module, device_map: Dict[str, Device]) -> Dict[str, Device]:
    """{tensor name: device} from a module-level map; unplaced names and unknown keys are errors."""
    if not isinstance(device_map, dict) or not device_map:
        raise ConfigurationError(
            f"device_map={device_map!r} must be a non-empty dict {{module name: device}} or one of {list(MODES)}"
        )
    names = list(_all_tensors(model))
    modules = {n for n, _ in model.named_modules(remove_duplicate=False)}
    out: Dict[str, Device] = {}
    for key in sorted(device_map, key=len):
        dev = normalize_device(device_map[key], f"device_map[{key!r}]")
        if key not in modules and key not in names:
            raise ConfigurationError(
                f"device_map key {key!r} is neither a module nor a tensor of the model; module "
                f"names look like {sorted(modules - {''})[:4]}"
            )
        for n in names:
            if key == "" or n == key or n.startswith(key + "."):
                out[n] = dev
    missing = [n for n in names if n not in out]
    if missing:
        raise ConfigurationError(
            f"device_map leaves {len(missing)} weight(s) unplaced, first {missing[:5]}; add "
            f"their modules to the map (or map '' to a device)"
        )
    for group in tie_groups(model):
        devs = {out[n] for n in group}
        if len(devs) > 1:
            raise ConfigurationError(
                f"tied weights {group} are mapped to different devices {sorted(map(str, devs))}; "
                f"a tie group must share one device"
            )
    return out


def _exec_device(per_tensor: Dict[str, Device], execution_device) -> torch.device:
    if execution_device is not None:
        d = normalize_device(execution_device, "execution_device")
        return torch.device("cuda", d) if isinstance(d, int) else torch.device("cpu")
    gpus = sorted({d for d in per_tensor.values() if isinstance(d, int)})
    return torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")


def _torch_device(d: Device) -> torch.device:
    return torch.device("cuda", d) if isinstance(d, int) else torch.device("cpu")


def _refuse_to(model: nn.Module) -> None:
    def refuse(*args, **kwargs):
        raise ConfigurationError(
            "this model was dispatched with a device map (model.hf_device_map); .to()/.cuda()/"
            ".cpu() would undo it. Call trainforge.inference.remove_dispatch(model) first or "
            "dispatch again with another map"
        )

    for attr in ("to", "cuda", "cpu"):
        setattr(model, attr, refuse)


def remove_dispatch(model: nn.Module) -> nn.Module:
    """Remove the hooks and the .to() guard; weights stay where they are."""
    runner = getattr(model, "_trainforge_runner", None)
    if runner is not None:
        runner.remove()
    for attr in ("to", "cuda", "cpu"):
        model.__dict__.pop(attr, None)
    for h in getattr(model, "_trainforge_handles", []):
        h.remove()
    return model


def attach(  # noqa: C901 - the hooks of one dispatched model, installed together
    model: nn.Module,
    device_map: Dict[str, Device],
    per_tensor: Dict[str, Device],
    execution_device=None,
    prefetch: bool = True,
    mapped: Sequence[MappedFile] = (),
) -> nn.Module:
    """Hooks for the blocks of ``device_map`` whose weights are not on the execution device; with
    ``mapped`` (the files the model's weights are memory-mapped from), every forward first checks that
    none of them was truncated or rewritten (touching such a mapping is a SIGBUS, not an exception)."""
    if not isinstance(prefetch, bool):
        raise ConfigurationError(
            f"prefetch={prefetch!r} must be True or False (True: on CUDA, copy the next block while this one runs)"
        )
    remove_dispatch(model)
    exec_dev = _exec_device(per_tensor, execution_device)
    runner = Runner(exec_dev, prefetch=prefetch)
    handles = []
    real = {_torch_device(d) for d in per_tensor.values()} | {exec_dev}
    modules = dict(model.named_modules(remove_duplicate=False))
    per_module: Dict[str, list] = {}
    for key, dev in device_map.items():
        dev = normalize_device(dev)
        module_name = key if key in modules else key.rpartition(".")[0]
        module = modules[module_name]
        if dev in ("cpu", "disk") and exec_dev.type != "cpu":
            prefix = key + "." if key else ""
            slots = per_module.setdefault(module_name, [])
            for sub_name, sub in module.named_modules(remove_duplicate=False, prefix=module_name):
                for leaf, t in list(sub._parameters.items()) + list(sub._buffers.items()):
                    full = f"{sub_name}.{leaf}" if sub_name else leaf
                    if t is not None and (full == key or full.startswith(prefix) or key == ""):
                        slots.append((sub, leaf, t))
        elif len(real) > 1:  # a block on a GPU of a multi-device map: its inputs must come along
            target = _torch_device(dev) if dev not in ("cpu", "disk") else exec_dev
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, k, t=target: (send_to(a, t), send_to(k, t)), with_kwargs=True
                )
            )
    for module_name, slots in per_module.items():
        if slots:
            runner.add(modules[module_name], slots)
    if len(real) > 1:  # outputs come back where the inputs were
        state: Dict[str, Optional[torch.device]] = {"dev": None}
        handles.append(
            model.register_forward_pre_hook(
                lambda m, a, k: state.__setitem__("dev", first_device(a, k)), with_kwargs=True
            )
        )
        handles.append(
            model.register_forward_hook(
                lambda m, a, k, o: send_to(o, state["dev"]) if state["dev"] is not None else o, with_kwargs=True
            )
        )
    if mapped:
        files = list(mapped)

        def check_files(module: nn.Module, args: tuple, kwargs: dict) -> None:
            for f in files:
                f.check()

        handles.append(model.register_forward_pre_hook(check_files, with_kwargs=True, prepend=True))
    # plain attributes (nn.Module's __setattr__ is typed for tensors and modules only)
    setattr(model, "_trainforge_runner", runner)  # noqa: B010
    setattr(model, "_trainforge_handles", handles)  # noqa: B010
    setattr(model, "hf_device_map", dict(device_map))  # noqa: B010
    _refuse_to(model)
    return model


def dispatch_model(
    model: nn.Module, device_map: Dict[str, Device], offload_dir=None, execution_device=None, prefetch: bool = True
) -> nn.Module:
    """Move an in-memory model's weights per ``device_map``; "disk" ones are written once to
    ``offload_dir`` as safetensors and memory-mapped back (ties kept)."""
    per_tensor = resolve_map(model, device_map)
    groups = tie_groups(model)
    tensors = _all_tensors(model)
    metas = [n for n, t in tensors.items() if t.device.type == "meta"]
    if metas:
        raise ConfigurationError(
            f"dispatch_model got weights still on meta, first {metas[:3]}; use "
            f"load_checkpoint_and_dispatch to load them"
        )
    disk = {n: t for n, t in tensors.items() if per_tensor[n] == "disk"}
    files: List[MappedFile] = []
    if disk:
        folder = check_writable(offload_dir, "the device map sends weights to 'disk'")
        seen, uniq = {}, {}
        for n, t in disk.items():
            if id(t) not in seen:
                seen[id(t)] = n
                uniq[n] = t
        path = write_offload(folder, "model-offload", uniq)
        files = [MappedFile(path)]
        views = mmap_safetensors(path)
        for n, t in disk.items():
            set_tensor(model, n, views[seen[id(t)]])
    done: Dict[tuple, torch.Tensor] = {}
    for n, t in tensors.items():
        dev = per_tensor[n]
        if dev in ("cpu", "disk"):
            if dev == "cpu" and t.device.type != "cpu":
                set_tensor(model, n, done.setdefault((id(t), "cpu"), t.detach().to("cpu")))
            continue
        if (id(t), dev) not in done:  # tied names share one copy per device
            done[(id(t), dev)] = t.detach().to(_torch_device(dev))
        set_tensor(model, n, done[(id(t), dev)])
    retie(model, list(groups))
    return attach(model, device_map, per_tensor, execution_device, prefetch, files)


def _check_keys(model: nn.Module, source: Source, groups: List[List[str]], checkpoint) -> Dict[str, str]:
    """{model name: checkpoint name}; missing, unexpected or mis-shaped tensors are one clear error."""
    expected = {n: tuple(t.shape) for n, t in _all_tensors(model).items()}
    volatile = {
        f"{m}.{b}" if m else b
        for m, mod in model.named_modules(remove_duplicate=False)
        for b in mod._non_persistent_buffers_set
    }
    have = set(source.entries) | set(source.aliases)
    take: Dict[str, str] = {}
    missing = []
    for n in expected:
        if n in have:
            take[n] = source.aliases.get(n, n)
        else:
            group = next((g for g in groups if n in g), [])
            other = next((o for o in group if o in have), None)
            if other is not None:
                take[n] = source.aliases.get(other, other)
            elif n in volatile:
                continue  # a non-persistent buffer: never in checkpoints
            else:
                missing.append(n)
    unexpected = sorted(set(source.entries) - set(take.values()))
    shapes = [
        f"{n}: checkpoint {source.entries[c][2]} vs model {expected[n]}"
        for n, c in take.items()
        if c in source.entries and source.entries[c][2] != expected[n]
    ]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r} does not match the model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}, shape mismatches {shapes[:5]}; load the "
            f"checkpoint saved from this model's config"
        )
    return take


def load_checkpoint_and_dispatch(  # noqa: C901 - one branch per checkpoint form and offload target
    model: nn.Module,
    checkpoint: Union[str, os.PathLike],
    device_map: Union[str, Dict[str, Device], None] = "auto",
    max_memory=None,
    no_split_module_classes: Optional[Sequence[str]] = None,
    offload_folder=None,
    dtype: Optional[torch.dtype] = None,
    execution_device=None,
    prefetch: bool = True,
) -> nn.Module:
    """Load ``checkpoint`` (safetensors file, HF index, trainforge checkpoint directory) into ``model``
    (usually built under ``init_empty_weights``) and dispatch it per ``device_map``."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ConfigurationError(f"dtype={dtype!r} is not a torch.dtype; give e.g. torch.float16 or None")
    source = open_source(checkpoint)
    groups = tie_groups(model)
    take = _check_keys(model, source, groups, checkpoint)
    if device_map is None:
        device_map = {"": "cpu"}
    if isinstance(device_map, str):
        if device_map not in MODES:
            raise ConfigurationError(
                f"device_map={device_map!r} is not one of: {', '.join(MODES)} (or a dict {{module name: device}})"
            )
        device_map = infer_auto_device_map(model, max_memory, no_split_module_classes, dtype, mode=device_map)
    per_tensor = resolve_map(model, device_map)
    wanted: Dict[str, List[str]] = {}
    for n, c in take.items():
        wanted.setdefault(c, []).append(n)
    convert = not source.is_safetensors and any(per_tensor[n] == "disk" for n in take)
    folder = (
        check_writable(offload_folder, "the checkpoint is not safetensors and weights go to 'disk'")
        if convert
        else None
    )
    placed: Dict[tuple, torch.Tensor] = {}
    files = {shard: MappedFile(shard) for shard in source.shards}  # size and mtime before mapping
    used = set()  # the files that weights left on the host stay views of
    for i, (shard, tensors) in enumerate(source.tensors()):  # one shard mapped at a time
        origin = dict.fromkeys(tensors, shard)
        if folder is not None and shard.suffix != ".safetensors":
            offload = {c: t for c, t in tensors.items() if any(per_tensor[n] == "disk" for n in wanted.get(c, []))}
            if offload:
                path = write_offload(folder, f"offload-{i:05d}", offload)
                files[path] = MappedFile(path)
                tensors.update(mmap_safetensors(path))
                origin.update(dict.fromkeys(offload, path))
        for c, t in tensors.items():
            for n in wanted.get(c, []):
                dev = per_tensor[n]
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    t = t.to(dtype)  # a cast is a copy: only done when asked
                elif dev in ("cpu", "disk"):
                    used.add(origin[c])
                if dev not in ("cpu", "disk"):  # tied names share one copy per device
                    if (c, dev) not in placed:
                        placed[(c, dev)] = t.to(_torch_device(dev))
                    t = placed[(c, dev)]
                set_tensor(model, n, placed.setdefault((c, "host"), t) if dev in ("cpu", "disk") else t)
        del tensors
    retie(model, groups)
    for n, t in _all_tensors(model).items():
        if n in take:
            continue
        if t.device.type == "meta":  # a non-persistent buffer no checkpoint holds
            raise CheckpointError(
                f"{n!r} is a non-persistent buffer still on meta, and no checkpoint holds it; build "
                f"the model under trainforge.inference.init_empty_weights(), which keeps such "
                f"buffers real"
            )
        if per_tensor[n] not in ("cpu", "disk"):
            set_tensor(model, n, t.to(_torch_device(per_tensor[n])))
    return attach(model, device_map, per_tensor, execution_device, prefetch, [files[p] for p in used])


def cpu_offload(model: nn.Module, execution_device=None, prefetch: bool = True) -> nn.Module:
    """Weights stay in CPU memory; each module's own weights visit ``execution_device`` during its forward."""
    device_map = _leaf_map(model, "cpu")
    return dispatch_model(model, device_map, execution_device=execution_device or _default_exec(), prefetch=prefetch)


def disk_offload(model: nn.Module, offload_dir, execution_device=None, prefetch: bool = True) -> nn.Module:
    """Weights memory-mapped from safetensors in ``offload_dir``. A meta model is loaded from the
    checkpoint already there (nothing in memory); an in-memory one is written there once first."""
    if any(t.device.type == "meta" for t in _all_tensors(model).values()):
        return load_checkpoint_and_dispatch(
            model,
            offload_dir,
            _leaf_map(model, "disk"),
            execution_device=execution_device or _default_exec(),
            prefetch=prefetch,
        )
    return dispatch_model(
        model,
        _leaf_map(model, "disk"),
        offload_dir=offload_dir,
        execution_device=execution_device or _default_exec(),
        prefetch=prefetch,
    )


def _default_exec():
    return 0 if torch.cuda.is_available() else "cpu"


def _leaf_map(model: nn.Module, dev: str) -> Dict[str, Device]:
    """One block per module holding tensors of its own (so one module's weights are on the device at a time)."""
    out: Dict[str, Device] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        for leaf, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is not None:
                out[f"{name}.{leaf}" if name else leaf] = dev
    return out
