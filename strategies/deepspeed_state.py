"""DeepSpeedStrategy's weights and checkpoints (a mixin of ``DeepSpeedStrategy``): full state dicts
gathered from ZeRO partitions, DeepSpeed's own checkpoint format inside trainforge's directory (loaded
with ``weights_only``), and the bytes each rank holds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import torch
from torch import nn

from trainforge.strategies.checkpoint.verify import file_crc32, read_metadata
from trainforge.strategies.errors import CheckpointError

CHECKPOINT_DIR = "deepspeed"  # inside a trainforge checkpoint directory
TAG = "state"  # DeepSpeed's tag sub-directory


class DeepSpeedState:
    """Mixed into ``DeepSpeedStrategy``; uses its engines (``_engine_of``, ``_is_engine``)."""

    if TYPE_CHECKING:  # DeepSpeedStrategy's, for the type checker
        _ds: Any  # the deepspeed module

        @property
        def root_device(self) -> torch.device: ...
        @property
        def world_size(self) -> int: ...
        @property
        def is_global_zero(self) -> bool: ...
        def unwrap(self, module: nn.Module) -> nn.Module: ...
        def _engine_of(self, module: Optional[nn.Module]) -> Any: ...

    def module_state_dict(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """Full fp32 weights on every rank (master weights under mixed precision); collective.
        Tied parameters come back as one tensor under each name."""
        from deepspeed.utils import safe_get_full_fp32_param

        full: Dict[int, torch.Tensor] = {}
        out: Dict[str, torch.Tensor] = {}
        for name, value in self.unwrap(module).state_dict(keep_vars=True).items():
            if not isinstance(value, nn.Parameter):
                out[name] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
                continue
            if id(value) not in full:
                tensor = None
                if value.requires_grad and (hasattr(value, "_z3_optimizer") or hasattr(value, "_hp_mapping")):
                    tensor = safe_get_full_fp32_param(value)  # all-gathers the fp32 partition
                if tensor is None and hasattr(value, "ds_id"):  # ZeRO-3 without master copy (frozen, no optimizer)
                    with self._ds.zero.GatheredParameters([value], modifier_rank=None):
                        tensor = value.detach().clone()
                full[id(value)] = (tensor if tensor is not None else value.detach()).cpu()
            out[name] = full[id(value)]
        return out

    def load_module_state_dict(self, module: nn.Module, state: Dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy full weights into the (partitioned) parameters and DeepSpeed's fp32 master copies.
        ZeRO-3 masters are refreshed from the parameters (``refresh_fp32_params``): DeepSpeed
        0.19.8's ``safe_set_full_fp32_param`` fails on padded stage-3 partitions (numel not
        divisible by the world size); under bf16 that rounds the masters to bf16 once."""
        from deepspeed.utils import safe_set_full_fp32_param

        engine = self._engine_of(module)
        current = self.unwrap(module).state_dict(keep_vars=True)
        missing, unexpected = sorted(set(current) - set(state)), sorted(set(state) - set(current))
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"state dict does not match the model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}; pass strict=False to load the common keys"
            )
        partitioned = False
        with torch.no_grad():
            for name, target in current.items():
                if name not in state or not isinstance(target, torch.Tensor):
                    continue
                source = state[name]
                if hasattr(target, "ds_id"):  # ZeRO-3: rank 0 writes the gathered tensor, then it is re-partitioned
                    partitioned = True
                    with self._ds.zero.GatheredParameters([target], modifier_rank=0):
                        if self.is_global_zero:
                            target.data.copy_(source.reshape(target.shape))
                    continue
                target.data.copy_(source)
                if getattr(target, "_hp_mapping", None) is not None and target.requires_grad:
                    safe_set_full_fp32_param(target, source.to(self.root_device, torch.float32))
        if partitioned and hasattr(engine.optimizer, "refresh_fp32_params"):
            engine.optimizer.refresh_fp32_params()

    def save_checkpoint(self, writer: Any, module: nn.Module, optimizers: Sequence[Any]) -> None:
        """DeepSpeed's own shards (every rank writes its part) into ``<tmp_dir>/deepspeed/state``;
        rank 0 hashes them into the manifest at ``finalize``."""
        engine = self._engine_of(module)
        staging = writer.deferred_engine(engine)
        with staging:  # asynchronous save: the engine's files are staged now, written in the background
            engine.save_checkpoint(str(writer.tmp_dir / CHECKPOINT_DIR), tag=TAG, client_state={}, save_latest=False)

    def load_checkpoint(self, path: Any, module: nn.Module, optimizers: Sequence[Any]) -> None:
        path = Path(path)
        meta = read_metadata(path)
        source = path / CHECKPOINT_DIR / TAG
        if not source.is_dir():
            raise CheckpointError(
                f"{path} holds no DeepSpeed state ({source} is missing): it was written by "
                f"strategy={meta.get('strategy')!r}; resume it with that strategy, or load its "
                "weights with strategy.load_module_state_dict(model, load_tensors(path))"
            )
        if int(meta.get("world_size", 1)) != self.world_size:
            raise CheckpointError(
                f"{path} holds ZeRO shards of {meta.get('world_size')} process(es) but this run has "
                f"{self.world_size}; resume with {meta.get('world_size')} processes (ZeRO shards are "
                "per rank), or start from its consolidated weights"
            )
        verify_subtree(path, meta, CHECKPOINT_DIR)
        engine = self._engine_of(module)
        load_path, _ = engine.load_checkpoint(
            str(path / CHECKPOINT_DIR),
            tag=TAG,
            load_module_strict=True,
            load_optimizer_states=bool(optimizers),
            load_lr_scheduler_states=False,
        )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load {source}; see its log above")


def local_state_bytes(engine: Any) -> Dict[str, int]:
    """Bytes this rank holds, counted once per storage: ``params`` (the module's parameters: a
    ZeRO-3 rank's partition), ``optimizer`` (fp32 master partitions + the wrapped optimizer's
    states), ``grads`` (``.grad`` and the gradient partitions the ZeRO optimizer keeps; call it
    between backward and step, since step frees them) and ``buffers`` (gradient reduction buckets,
    not in ``total``)."""
    seen: set = set()

    def size(tensors: Any) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, (list, tuple)):
                total += size(t)
            elif isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen | {0}:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    params = list(engine.module.parameters())
    ds_opt = engine.optimizer
    base = getattr(ds_opt, "optimizer", ds_opt)
    out = {
        "params": size(getattr(p, "ds_tensor", p) for p in params),
        "optimizer": size(
            [p for g in base.param_groups for p in g["params"]]  # ZeRO-3 empties these
            + list(getattr(ds_opt, "fp32_partitioned_groups_flat", []))  # outside step()
            + list(getattr(ds_opt, "single_partition_of_fp32_groups", []))
            + [v for st in base.state.values() for v in st.values()]
        ),
        "grads": size(
            [p.grad for p in params]
            + list(getattr(ds_opt, "averaged_gradients", {}).values())
            + [getattr(ds_opt, "grad_partitions_flat_buffer", None)]
        ),
    }
    out["total"] = out["params"] + out["optimizer"] + out["grads"]
    out["buffers"] = size(b.buffer for b in getattr(ds_opt, "ipg_buckets", {}).values() if hasattr(b, "buffer"))
    return out


def verify_subtree(path: Path, meta: Dict[str, Any], subdir: str) -> None:
    """Every file under ``path/subdir`` must be in the manifest with its recorded size and crc32,
    so DeepSpeed is handed only files this checkpoint's save wrote, intact."""
    files = meta.get("files", {})
    for file in sorted(p for p in (path / subdir).rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        entry = files.get(rel)
        if entry is None:
            raise CheckpointError(
                f"{file}: not in the manifest of {path}; it was not written by this checkpoint's save (remove it)"
            )
        size, crc = file_crc32(file)
        if size != entry.get("size") or crc != entry.get("crc32"):
            raise CheckpointError(
                f"{file}: size/crc32 {size}/{crc} on disk, {entry.get('size')}/{entry.get('crc32')} "
                "in the manifest; the file is corrupted or was replaced"
            )
