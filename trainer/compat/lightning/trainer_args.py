"""Lightning's Trainer arguments that trainforge maps onto its own, each checked before any work with an
error naming the value, the valid choices and the fix (issue 20).

- ``devices`` / ``num_nodes``: how many processes the run has and, on an accelerator, which devices.
  ``"auto"`` (the default): the processes the launcher started (one in a plain ``python script.py``;
  Lightning's ``"auto"`` takes every GPU). ``N``: N processes per node (on CPU too, as Lightning);
  ``-1``: one per visible accelerator device; ``[1, 3]``: one per listed device index (rank 0 on
  ``cuda:1``, rank 1 on ``cuda:3``); the strings ``"2"``, ``"-1"``, ``"1,3"`` as Lightning reads
  them. Under a launcher (``trainforge launch``, torchrun, SLURM, MPI) they must agree with the
  processes it started; from a plain ``python script.py``, ``devices=N`` makes this process rank 0
  and starts the N - 1 others (``trainer/cluster/script_launcher.py``).
- ``deterministic``: ``torch.use_deterministic_algorithms`` (``"warn"``: ``warn_only=True``), and
  with it cuDNN's benchmark off and ``CUBLAS_WORKSPACE_CONFIG`` set, as Lightning does; None leaves
  torch's setting alone.
- ``logger``: trainforge's trackers (``trainforge.callbacks.CSVLogger``, ``TensorBoardLogger``,
  ``MLflowLogger``, ``CometLogger``; also ``trainforge.lightning.loggers``). True (and None) installs Lightning's
  default logger unless one is in ``callbacks``: ``TensorBoardLogger`` when tensorboard is installed, else
  ``CSVLogger``, under ``<default_root_dir>/lightning_logs/version_<N>`` (and the checkpoints in its
  ``checkpoints/``); False installs none; a tracker or a list of them is added to the callbacks.
- ``min_epochs`` / ``min_steps``: ``trainer.should_stop`` (EarlyStopping, Timer) ends fit only once
  both are reached; ``max_epochs``/``max_steps`` still end it (``trainer/loop/fit_loop.py``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import torch

from trainforge.strategies import Strategy
from trainforge.strategies.devices import current_accelerator, normalize_accelerator
from trainforge.strategies.environment import ClusterEnvironment
from trainforge.strategies.errors import ConfigurationError, invalid_choice

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.callbacks.base import Checkpointer
    from trainforge.callbacks.early_stopping import EarlyStopping
    from trainforge.callbacks.trackers.base import TrackerCallback

log = logging.getLogger("trainforge")

DETERMINISTIC_CHOICES = (True, False, "warn", None)
_TRACKERS = "trainforge.callbacks: CSVLogger, TensorBoardLogger, MLflowLogger, CometLogger"
_DEVICES_CHOICES = "'auto', an int N >= 1 (N processes per node), -1 (every visible device) or a list of device indices"


@dataclass(frozen=True)
class DevicePlan:
    """What ``devices``/``num_nodes`` ask for: ``per_node`` processes on each node (None: what the
    launcher started) and, when device indices were listed, the index of each local rank's device."""

    per_node: Optional[int]
    num_nodes: int
    device_type: str
    indices: Optional[Tuple[int, ...]] = None

    def device_for(self, local_rank: int) -> Optional[torch.device]:
        return torch.device(self.device_type, self.indices[local_rank]) if self.indices is not None else None


def accelerator_type(accelerator: Any) -> str:
    """The device type ``accelerator`` trains on here: "cpu", or the accelerator torch reports."""
    kind = normalize_accelerator(accelerator)
    if kind == "cpu":
        return "cpu"
    found = current_accelerator()
    if found is None and torch.cuda.is_available():
        found = torch.device("cuda")
    if found is None:
        return "cpu" if kind == "auto" else kind  # an explicit accelerator that is missing: Accelerator says so
    return found.type


def _visible_count(device_type: str) -> int:
    if device_type == "cuda":
        return torch.cuda.device_count()
    if device_type == "mps":
        return 1
    acc = getattr(torch, "accelerator", None)  # torch's module, absent on an older torch
    return acc.device_count() if acc is not None else 1


def parse_devices(devices: Any, accelerator: Any, num_nodes: Any) -> DevicePlan:
    """Lightning's ``devices``/``accelerator``/``num_nodes``, checked: a count, an index list or "auto"."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigurationError(f"num_nodes={num_nodes!r} must be an int >= 1 (the number of machines)")
    kind = accelerator_type(accelerator if accelerator is not None else "auto")
    value = _devices_value(devices)
    if value is None:
        return DevicePlan(None, num_nodes, kind)
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise ConfigurationError(f"devices={devices!r} is not {_DEVICES_CHOICES}")
    if isinstance(value, int):
        return DevicePlan(_device_count(devices, value, kind), num_nodes, kind)
    indices = _device_indices(devices, tuple(value), kind)
    return DevicePlan(len(indices), num_nodes, kind, indices)


def _devices_value(devices: Any) -> Any:
    """Lightning's strings as values: "auto" -> None, "2", "-1", "1,3" (a trailing comma makes a list: "1,")."""
    if not isinstance(devices, str):
        return devices
    text = devices.strip().lower()
    if text == "auto":
        return None
    try:
        return [int(i) for i in text.split(",") if i.strip()] if "," in text else int(text)
    except ValueError:
        raise ConfigurationError(f"devices={devices!r} is not {_DEVICES_CHOICES}") from None


def _device_count(devices: Any, value: int, kind: str) -> int:
    if value == -1 and kind != "cpu":
        value = _visible_count(kind)
    if value < 1:
        hint = (
            "on CPU pass the number of processes, devices=N"
            if value == -1
            else "for a CPU run pass accelerator='cpu' and devices=1"
        )
        raise ConfigurationError(f"devices={devices!r}: {_DEVICES_CHOICES}; {hint}")
    return value


def _device_indices(devices: Any, indices: Tuple[Any, ...], kind: str) -> Tuple[int, ...]:
    if not indices or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices):
        raise ConfigurationError(
            f"devices={devices!r}: a list of devices holds device indices (ints >= 0), e.g. [0, 1]"
        )
    if len(set(indices)) != len(indices):
        raise ConfigurationError(f"devices={devices!r} names a device twice; list each device index once")
    if kind == "cpu":
        raise ConfigurationError(
            f"devices={devices!r}: a list picks accelerator devices by index, and this run is on the CPU; "
            f"pass devices={len(indices)} for {len(indices)} CPU process(es)"
        )
    count = _visible_count(kind)
    if max(indices) >= count:
        raise ConfigurationError(
            f"devices={devices!r}: index {max(indices)} does not exist, {count} {kind.upper()} device(s) are "
            f"visible (indices 0..{count - 1})"
        )
    return indices


def check_launched(plan: DevicePlan, env: ClusterEnvironment) -> None:
    """Under a launcher, ``devices``/``num_nodes`` must describe the processes it started."""
    nodes = env.world_size // max(env.local_world_size, 1)
    per_node = plan.per_node if plan.per_node is not None else env.local_world_size
    if per_node == env.local_world_size and plan.num_nodes == nodes:
        return
    raise ConfigurationError(
        f"Trainer(devices={plan.per_node if plan.per_node is not None else 'auto'}, num_nodes={plan.num_nodes}) "
        f"asks for {per_node} process(es) on each of {plan.num_nodes} node(s), but the launcher ({env.kind}) "
        f"started {env.local_world_size} per node on {nodes} node(s) (WORLD_SIZE={env.world_size}); "
        f"pass devices={env.local_world_size}, num_nodes={nodes} (or devices='auto'), or launch "
        f"with --nproc-per-node {per_node} --nnodes {plan.num_nodes}"
    )


def strategy_with_device(strategy: Union[str, Strategy, None], plan: DevicePlan, local_rank: int) -> Any:
    """The strategy choice, with the device of this local rank when devices were listed by index."""
    device = plan.device_for(local_rank)
    if device is None:
        return strategy
    if isinstance(strategy, Strategy):
        raise ConfigurationError(
            f"devices={list(plan.indices or ())} with a Strategy object: its device is its own; pass "
            f"{type(strategy).__name__}(device=...) and devices={plan.per_node}, or a strategy name"
        )
    from trainforge.strategies import LIGHTNING_ALIASES, resolve_strategy, strategy_class
    from trainforge.trainer.cli.launch_settings import launch_defaults, strategy_kwargs

    name = "auto" if strategy is None else str(strategy).lower()
    if name == "auto":
        name = "ddp" if plan.per_node is not None and plan.per_node * plan.num_nodes > 1 else "single"
    if LIGHTNING_ALIASES.get(name, (name,))[0] not in ("single", "ddp", "fsdp", "megatron"):
        strategy_class(name)  # an unknown name: its own error first
        raise ConfigurationError(
            f"devices={list(plan.indices or ())} with strategy={strategy!r}: that strategy picks its device "
            f"by local rank; select the devices with CUDA_VISIBLE_DEVICES={','.join(map(str, plan.indices or ()))} "
            f"and pass devices={plan.per_node}"
        )
    return resolve_strategy(name, device=device, **strategy_kwargs(name, launch_defaults()))


def apply_deterministic(deterministic: Any) -> None:
    if (
        deterministic not in DETERMINISTIC_CHOICES
        or isinstance(deterministic, (int, float))
        and not isinstance(deterministic, bool)
    ):
        raise invalid_choice(
            "deterministic",
            deterministic,
            DETERMINISTIC_CHOICES,
            "True makes torch use deterministic algorithms (an error where one has none), 'warn' only warns there",
        )
    if deterministic is None:
        return
    if deterministic:
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
    torch.use_deterministic_algorithms(bool(deterministic), warn_only=deterministic == "warn")


def check_summary_setting(enable_model_summary: Any, callbacks: List[Any]) -> None:
    from trainforge.callbacks.model_summary import ModelSummary

    if not isinstance(enable_model_summary, bool):
        raise ConfigurationError(f"enable_model_summary={enable_model_summary!r} must be True or False")
    if not enable_model_summary and any(isinstance(c, ModelSummary) for c in callbacks):
        raise ConfigurationError(
            "enable_model_summary=False, but callbacks holds a ModelSummary; drop one of them "
            "(ModelSummary(max_depth=0) prints nothing too)"
        )


def setup_processes(devices: Any, num_nodes: Any, accelerator: Any, strategy: Any) -> Any:
    """Check ``devices``/``num_nodes`` against the processes this run has, starting the others from a
    plain ``python script.py`` (``devices=N``); the strategy choice, with this rank's device if listed."""
    from trainforge.strategies.environment import detect_environment

    plan = parse_devices(devices, accelerator, num_nodes)
    if plan.per_node is None and plan.num_nodes == 1:
        return strategy  # the processes the launcher started, whatever they are
    env = detect_environment(os.environ)
    if env.kind != "single":
        check_launched(plan, env)
    elif plan.num_nodes > 1:
        raise ConfigurationError(
            f"num_nodes={plan.num_nodes} from a plain `python` process: start the script on every node with "
            f"`trainforge launch --nnodes {plan.num_nodes} --node-rank R --master-addr HOST "
            f"--nproc-per-node {plan.per_node or 1} script.py` (or under SLURM: srun)"
        )
    elif plan.per_node is not None and plan.per_node > 1:
        from trainforge.trainer.cluster.script_launcher import launch_script

        env = launch_script(plan.per_node)  # this process becomes rank 0 of per_node
    return strategy_with_device(strategy, plan, env.local_rank)


def callback_list(callbacks: Any, base: type) -> Any:
    """Lightning also takes one callback on its own (``callbacks=ModelCheckpoint(...)``); a callback of
    Lightning's own is refused with trainforge's name for it."""
    given = callbacks if isinstance(callbacks, (list, tuple)) else [] if callbacks is None else [callbacks]
    for index, callback in enumerate(given):
        _refuse_lightning_callback(callback, index if isinstance(callbacks, (list, tuple)) else None)
    return [callbacks] if isinstance(callbacks, base) else callbacks


def _refuse_lightning_callback(callback: Any, index: Optional[int]) -> None:
    cls = callback if isinstance(callback, type) else type(callback)
    if cls.__module__.split(".")[0] not in ("lightning", "pytorch_lightning"):
        return
    import trainforge.callbacks as ours

    where = "callbacks" if index is None else f"callbacks[{index}]"
    instead = (
        f"use trainforge.callbacks.{cls.__name__} (`from trainforge.callbacks import {cls.__name__}`), which takes "
        "Lightning's arguments"
        if cls.__name__ in ours.__all__
        else "write it as a trainforge.callbacks.Callback subclass (Lightning's on_* hooks, called with (trainer, "
        "module, ...))"
    )
    raise ConfigurationError(
        f"{where} is Lightning's {cls.__module__}.{cls.__name__}, which cannot run in trainforge's loop: {instead}"
    )


# Lightning 1.x Trainer arguments that Lightning 2.0 removed, and what to write instead (in trainforge).
REMOVED_ARGUMENTS = {
    "gpus": "accelerator='gpu', devices=N (Lightning 2.x's form)",
    "tpu_cores": "strategy='xla' under `trainforge launch --xla` (Lightning 2.x: accelerator='tpu', devices=N)",
    "auto_select_gpus": "devices=N (CUDA_VISIBLE_DEVICES picks which)",
    "resume_from_checkpoint": "trainer.fit(model, ..., ckpt_path=PATH) (Lightning 2.x's form), or resume='auto'",
    "auto_lr_find": "trainforge.Tuner(trainer).lr_find(model) (Lightning 2.x's Tuner)",
    "auto_scale_batch_size": "trainforge.Tuner(trainer).scale_batch_size(model) (Lightning 2.x's Tuner)",
    "amp_backend": "precision='16-mixed' or 'bf16-mixed' (torch.amp; Lightning 2.x's form)",
    "amp_level": "precision='16-mixed' or 'bf16-mixed' (torch.amp; Lightning 2.x's form)",
    "track_grad_norm": "logging the norm in on_before_optimizer_step (Lightning 2.x's way)",
    "replace_sampler_ddp": "nothing: trainforge shards a map-style loader's sampler by rank itself",
    "move_metrics_to_cpu": "nothing: logged metrics are kept as Python floats",
    "plugins": (
        "the setting the plugin carried: precision= for a precision plugin, strategy=<a Strategy object> for a "
        "strategy's options; a cluster environment is detected (torchrun, SLURM, MPI, Kubeflow) and checkpoint "
        "I/O takes fsspec URLs (default_root_dir='s3://...')"
    ),
}


def refuse_unknown_arguments(given: Dict[str, Any], accepted: List[str]) -> None:
    """``Trainer(**given)`` for arguments the Trainer does not take: Lightning 1.x's get the 2.x way."""
    for name, value in given.items():
        if name in REMOVED_ARGUMENTS:
            raise ConfigurationError(
                f"Trainer({name}={value!r}) is Lightning's and trainforge does not take it; pass "
                f"{REMOVED_ARGUMENTS[name]}"
            )
        raise ConfigurationError(
            f"Trainer() got an unknown argument {name}={value!r}; its arguments are: {', '.join(accepted)}"
        )


def tracker_callbacks(logger: Any, callbacks: List[Any]) -> Tuple[List[Any], bool]:
    """The callbacks with the trackers ``logger`` names added, and whether the default tracker is wanted."""
    from trainforge.callbacks.trackers.base import TrackerCallback

    if logger is None or logger is True:
        return callbacks, True
    if logger is False:
        given = [type(c).__name__ for c in callbacks if isinstance(c, TrackerCallback)]
        if given:
            raise ConfigurationError(
                f"logger=False turns the trackers off, but callbacks holds {', '.join(given)}; drop one of them"
            )
        return callbacks, False
    trackers = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    for i, tracker in enumerate(trackers):
        if not isinstance(tracker, TrackerCallback):
            where = "logger" if not isinstance(logger, (list, tuple)) else f"logger[{i}]"
            shown = (
                tracker.__name__
                if isinstance(tracker, type)
                else repr(tracker)
                if isinstance(tracker, (str, int, float, dict))
                else f"{type(tracker).__name__}(...)"
            )
            fix = (
                f"pass an instance, {tracker.__name__}(...)"
                if isinstance(tracker, type) and issubclass(tracker, TrackerCallback)
                else f"pass one of {_TRACKERS} (a Lightning logger is not one: change its import)"
            )
            raise ConfigurationError(
                f"{where}={shown} is not a trainforge tracker; {fix}, or logger=True (Lightning's default logger) / False (none)"
            )
    return callbacks + [t for t in trackers if not any(t is c for c in callbacks)], False


class LightningAttributes:
    """Lightning's Trainer attributes over the Trainer's callbacks (mixed into ``Trainer``)."""

    # The one mixin left in the Trainer: it only adds Lightning's read-only names (trainer.logger,
    # trainer.checkpoint_callback, ...), each a filter of the callback list, and changes no state. As a
    # part they would be six forwarding properties on the Trainer; here they stay with the other
    # Lightning translations. The list it reads is the host's ``callbacks``, declared here once.
    callbacks: List[Any]
    default_root_dir: str

    @property
    def loggers(self) -> List[TrackerCallback]:
        from trainforge.callbacks.trackers.base import TrackerCallback

        return [c for c in self.callbacks if isinstance(c, TrackerCallback)]

    @property
    def logger(self) -> Optional[TrackerCallback]:
        """The first tracker (Lightning's ``trainer.logger``), or None with ``logger=False``."""
        found = self.loggers
        return found[0] if found else None

    @property
    def log_dir(self) -> str:
        """Lightning's ``trainer.log_dir``: the first logger's version folder (CSVLogger, TensorBoardLogger),
        else ``default_root_dir``. Fixed for every rank when a fit starts; read before, it is this rank's."""
        logger = self.logger
        found = logger.log_dir if logger is not None else None
        return found if found is not None else str(self.default_root_dir)

    @property
    def checkpoint_callbacks(self) -> List[Checkpointer]:
        """Lightning's: the checkpointing callbacks (its ``Checkpoint`` base class is our ``Checkpointer``)."""
        from trainforge.callbacks.base import Checkpointer

        return [c for c in self.callbacks if isinstance(c, Checkpointer)]

    @property
    def checkpoint_callback(self) -> Optional[Checkpointer]:
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def early_stopping_callbacks(self) -> List[EarlyStopping]:
        from trainforge.callbacks.early_stopping import EarlyStopping

        return [c for c in self.callbacks if isinstance(c, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> Optional[EarlyStopping]:
        found = self.early_stopping_callbacks
        return found[0] if found else None
