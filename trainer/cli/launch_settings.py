"""Launch settings: the YAML file ``trainforge config`` writes (trainer/cli/config.py, which shows its
layout) and ``trainforge launch`` reads.

Precedence: built-in defaults < config file (``--config-file`` or the default file) < a cluster's variables
(PET_*, SKYPILOT_*; ``launch`` only: trainer/cli/cluster_env.py) < flags. ``launch``
writes the resolved settings to a temporary YAML file and exports its path as ``TRAINFORGE_LAUNCH_CONFIG``
to the workers; ``launch_defaults()`` reads it back there, and the Trainer/Accelerator use those values
where the user's code set nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

import yaml

from trainforge.strategies import STRATEGY_NAMES
from trainforge.strategies.errors import ConfigurationError, invalid_choice
from trainforge.strategies.precision import ALIASES as PRECISION_ALIASES
from trainforge.strategies.precision import PRECISIONS

LAUNCH_CONFIG_ENV = "TRAINFORGE_LAUNCH_CONFIG"
TRAINING_KEYS = (
    "accelerator",
    "strategy",
    "precision",
    "gradient_accumulation_steps",
    "activation_checkpointing",
    "deepspeed",
    "fsdp",
    "megatron",
)
MEGATRON_KEYS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "data_parallel",
    "num_microbatches",
    "schedule",
    "sequence_parallel",
    "loss_parallel",
    "tp_plan",
    "pp_split",
    "activation_checkpointing",
    "seq_len",
    "device_memory",
    "model_shape",
)

Parser = Callable[[str, Any], Any]


def _choice(*choices: str, aliases: Optional[Mapping[str, str]] = None) -> Parser:
    by_lower = {c.lower(): c for c in choices}
    by_lower.update(aliases or {})

    def parse(name: str, value: Any) -> str:
        text = str(value).strip()
        if text.lower() not in by_lower:
            raise invalid_choice(name, value, choices, "Pick one of those")
        return by_lower[text.lower()]

    parse.choices = choices  # type: ignore[attr-defined]  # shown in the questions
    return parse


def _integer(minimum: int, maximum: Optional[int] = None) -> Parser:
    def parse(name: str, value: Any) -> int:
        bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        try:
            number = int(str(value).strip()) if not isinstance(value, (bool, float)) else None
        except ValueError:
            number = None
        if number is None or number < minimum or (maximum is not None and number > maximum):
            raise ConfigurationError(f"{name}={value!r} must be an integer {bound}")
        return number

    return parse


def _positive_float(name: str, value: Any) -> float:
    try:
        number = float(str(value).strip()) if not isinstance(value, bool) else -1.0
    except ValueError:
        number = -1.0
    if not number > 0:
        raise ConfigurationError(f"{name}={value!r} must be a number of seconds > 0")
    return number


def _nnodes(name: str, value: Any) -> Any:
    parts = str(value).strip().split(":")
    numbers = [_integer(1)(name, p) for p in parts] if len(parts) in (1, 2) else []
    if not numbers or (len(numbers) == 2 and numbers[0] > numbers[1]):
        raise ConfigurationError(f"{name}={value!r} must be a node count >= 1 or 'MIN:MAX' with MIN <= MAX")
    return numbers[0] if len(numbers) == 1 else f"{numbers[0]}:{numbers[1]}"


def _text(name: str, value: Any) -> str:
    if value is None or not str(value).strip():
        raise ConfigurationError(f"{name}={value!r} must not be empty")
    return str(value).strip()


def _default_nproc(answers: Mapping[str, Any]) -> int:
    if answers.get("accelerator") == "cpu":
        return 1
    import torch  # device_count() reads NVML; it does not initialise CUDA

    return max(torch.cuda.device_count(), 1)


def _activation(name: str, value: Any) -> Any:
    """An ``activation_checkpointing`` value (every strategy's), checked now, passed on as written."""
    from trainforge.strategies.activation_memory import parse_activation_checkpointing

    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"  # a flag's text
    try:
        parse_activation_checkpointing(value)
    except ConfigurationError as error:
        raise ConfigurationError(f"{name}: {error}") from None
    return value


@dataclass(frozen=True)
class Setting:
    """One setting: its key (dotted for the nested deepspeed/fsdp sections), flag and question."""

    key: str
    flag: str
    question: str
    parse: Parser
    default: Any = None  # a value or a function of the answers so far
    ask_if: Callable[[Mapping[str, Any]], bool] = lambda answers: True
    asked: bool = True  # False: flag/file only, never asked nor defaulted

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


def _multi(a: Mapping[str, Any]) -> bool:
    return a.get("compute_environment") == "multi_node"


def _ds(a: Mapping[str, Any]) -> bool:
    return a.get("strategy") == "deepspeed"


SETTINGS = (
    Setting(
        "compute_environment",
        "--compute-environment",
        "Where will you train?",
        _choice("this_machine", "multi_node"),
        "this_machine",
    ),
    Setting("nnodes", "--nnodes", "How many machines (nodes)?", _nnodes, 2, _multi),
    Setting("node_rank", "--node-rank", "Rank of this machine (0 for the main one)?", _integer(0), 0, _multi),
    Setting("master_addr", "--master-addr", "Address of the rank-0 machine?", _text, "127.0.0.1", _multi),
    Setting("master_port", "--master-port", "Port on the rank-0 machine?", _integer(1, 65535), 29500, _multi),
    Setting(
        "rdzv_backend",
        "--rdzv-backend",
        "Rendezvous backend?",
        _choice("static", "c10d", "etcd", "etcd-v2"),
        "static",
        _multi,
    ),
    Setting("rdzv_endpoint", "--rdzv-endpoint", "Rendezvous endpoint host:port", _text, asked=False),
    Setting("max_restarts", "--max-restarts", "Restarts of the whole group on a failure", _integer(0), asked=False),
    Setting(
        "monitor_interval", "--monitor-interval", "Seconds between worker health checks", _positive_float, asked=False
    ),
    Setting(
        "shutdown_timeout",
        "--shutdown-timeout",
        "Seconds the workers get to save and exit after a stop signal, before SIGKILL",
        _integer(0),
        asked=False,
    ),
    Setting("accelerator", "--accelerator", "Which device type?", _choice("auto", "cpu", "gpu"), "auto"),
    Setting("nproc_per_node", "--nproc-per-node", "How many processes per machine?", _integer(1), _default_nproc),
    Setting("strategy", "--strategy", "Which strategy?", _choice(*STRATEGY_NAMES), "auto"),
    Setting("deepspeed.zero_stage", "--zero-stage", "DeepSpeed ZeRO stage?", _integer(0, 3), 2, _ds),
    Setting(
        "deepspeed.offload_optimizer_device",
        "--offload-optimizer-device",
        "Offload optimizer state to?",
        _choice("none", "cpu", "nvme"),
        "none",
        _ds,
    ),
    Setting(
        "deepspeed.offload_param_device",
        "--offload-param-device",
        "Offload parameters to?",
        _choice("none", "cpu", "nvme"),
        "none",
        lambda a: _ds(a) and a.get("deepspeed.zero_stage") == 3,
    ),
    Setting(
        "fsdp.sharding_strategy",
        "--fsdp-sharding-strategy",
        "FSDP sharding strategy?",
        _choice("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"),
        "FULL_SHARD",
        lambda a: a.get("strategy") == "fsdp",
    ),
    Setting("precision", "--precision", "Which precision?", _choice(*PRECISIONS, aliases=PRECISION_ALIASES), "32"),
    Setting(
        "gradient_accumulation_steps", "--gradient-accumulation-steps", "Gradient accumulation steps?", _integer(1), 1
    ),
    Setting(
        "activation_checkpointing",
        "--activation-checkpointing",
        "Activation memory: none, full, selective:<n>, op or offload (every strategy)",
        _activation,
        asked=False,
    ),
)
_BY_KEY = {s.key: s for s in SETTINGS}


def default_config_path(environ: Mapping[str, str] = os.environ) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "trainforge" / "default_config.yaml"


def validate(settings: Mapping[str, Any], source: str = "") -> Dict[str, Any]:
    """Checks settings that depend on each other; returns a copy. ``source`` names where they came from."""
    where = f" ({source})" if source else ""
    nnodes, node_rank = settings.get("nnodes"), settings.get("node_rank")
    if isinstance(nnodes, int) and node_rank is not None and node_rank >= nnodes:
        raise ConfigurationError(
            f"node_rank={node_rank} must be < nnodes={nnodes}{where}; number the machines 0 .. nnodes-1"
        )
    if settings.get("megatron") and settings.get("strategy") != "megatron":
        raise ConfigurationError(
            f"a megatron section (MegatronStrategy arguments) needs strategy megatron, but "
            f"strategy={settings.get('strategy')!r}{where}: set strategy: megatron, or remove it"
        )
    deepspeed = sorted(k for k in settings if k.startswith("deepspeed.") and settings[k] is not None)
    # DeepSpeed flags under another strategy would be ignored without a word: refused
    # (tests/trainer/test_cli.py, test_bad_inputs_are_reported_without_traceback)
    if deepspeed and settings.get("strategy") != "deepspeed":
        flags = ", ".join("--" + k.split(".", 1)[1].replace("_", "-") for k in deepspeed)
        raise ConfigurationError(
            f"{flags} {'is a DeepSpeed setting' if len(deepspeed) == 1 else 'are DeepSpeed settings'}"
            f", but strategy={settings.get('strategy')!r}{where}: add --strategy deepspeed, or "
            "leave them out"
        )
    offload_param = settings.get("deepspeed.offload_param_device", "none")
    if offload_param != "none" and settings.get("deepspeed.zero_stage") != 3:
        raise ConfigurationError(
            f"deepspeed offload_param_device={offload_param!r} needs zero_stage=3, "
            f"got zero_stage={settings.get('deepspeed.zero_stage')!r}{where}"
        )
    # What the workers would refuse at start, refused here: `config` never writes what `launch` rejects.
    nproc = settings.get("nproc_per_node")
    if settings.get("strategy") == "single" and (
        (isinstance(nproc, int) and nproc > 1) or str(nnodes or 1) not in ("1", "1:1")
    ):
        raise ConfigurationError(
            f"strategy='single' runs one process, but nproc_per_node={nproc!r}, "
            f"nnodes={nnodes or 1!r}{where}; choose strategy ddp (or auto, fsdp, deepspeed), "
            "or one process"
        )
    precision = settings.get("precision")
    if settings.get("accelerator") == "cpu" and precision in ("16-mixed", "fp8"):
        raise ConfigurationError(
            f"precision={precision!r} needs a GPU, but accelerator='cpu'{where}; "
            "use precision bf16-mixed (or 32) on CPU"
        )
    return dict(settings)


def flags_given(args: argparse.Namespace) -> Dict[str, Any]:
    """The settings given as flags on the command line, parsed (errors name the flag)."""
    return {s.key: s.parse(s.flag, getattr(args, s.dest)) for s in SETTINGS if getattr(args, s.dest, None) is not None}


def load_config(path: str | os.PathLike[str]) -> Dict[str, Any]:
    """Reads and validates a config file into flat settings ("deepspeed.zero_stage": 3, ...)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(
            f"config file {str(path)!r} does not exist; write one with "
            "`trainforge config --config-file PATH` or fix the path"
        )
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigurationError(f"config file {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(document, dict):
        raise ConfigurationError(f"config file {str(path)!r} must hold a mapping of settings")
    flat: Dict[str, Any] = {}
    megatron = document.pop("megatron", None)  # MegatronStrategy's own arguments, kept as a mapping
    if megatron is not None:
        if not isinstance(megatron, dict):
            raise ConfigurationError(
                f"megatron in {path} must be a mapping of MegatronStrategy arguments, e.g. "
                "megatron: {tensor_parallel_size: 2}"
            )
        unknown = sorted(set(megatron) - set(MEGATRON_KEYS), key=str)
        if unknown:
            raise ConfigurationError(
                f"megatron.{unknown[0]} (in {path}) is not a MegatronStrategy setting; valid "
                f"keys: {', '.join(MEGATRON_KEYS)}"
            )
    for key, value in document.items():
        if key in ("deepspeed", "fsdp") and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    settings = {}
    for key, value in flat.items():
        if key not in _BY_KEY:
            raise invalid_choice(f"key in {path}", key, _BY_KEY, "Remove or rename it")
        settings[key] = _BY_KEY[key].parse(f"{key} (in {path})", value)
    if megatron is not None:
        settings["megatron"] = dict(megatron)
    return validate(settings, str(path))


@contextlib.contextmanager
def settings_for_workers(settings: Mapping[str, Any]) -> Iterator[str]:
    """The launch settings in a temporary YAML file that ``LAUNCH_CONFIG_ENV`` names while the block runs
    (inherited by every worker process a launcher starts); removed and the variable restored after."""
    fd, path = tempfile.mkstemp(prefix="trainforge-launch-", suffix=".yaml")
    os.close(fd)
    previous = os.environ.get(LAUNCH_CONFIG_ENV)
    try:
        save_config(settings, path)
        os.environ[LAUNCH_CONFIG_ENV] = path
        yield path
    finally:
        os.remove(path)
        if previous is None:
            os.environ.pop(LAUNCH_CONFIG_ENV, None)
        else:
            os.environ[LAUNCH_CONFIG_ENV] = previous


def save_config(settings: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Writes flat settings as nested YAML, atomically (temporary file renamed into place)."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    document: Dict[str, Any] = {}
    for key in (s.key for s in SETTINGS if s.key in settings):
        section, _, name = key.rpartition(".")
        (document.setdefault(section, {}) if section else document)[name or key] = settings[key]
    if settings.get("megatron"):
        document["megatron"] = dict(settings["megatron"])
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".yaml")
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(document, handle, sort_keys=False)
    os.replace(tmp, path)
    return path


def launch_defaults(environ: Mapping[str, str] = os.environ) -> Dict[str, Any]:
    """Training settings handed down by ``trainforge launch`` ({} when not launched by it): keys among
    accelerator, strategy, precision, gradient_accumulation_steps, deepspeed (dict), fsdp (dict)."""
    path = environ.get(LAUNCH_CONFIG_ENV)
    if not path:
        return {}
    if not Path(path).is_file():
        raise ConfigurationError(
            f"{LAUNCH_CONFIG_ENV}={path!r} does not exist; it is written by "
            "`trainforge launch` for its workers: unset it when running otherwise"
        )
    defaults: Dict[str, Any] = {}
    for key, value in load_config(path).items():
        section, _, name = key.partition(".")
        if section in TRAINING_KEYS and name:
            defaults.setdefault(section, {})[name] = value
        elif section in TRAINING_KEYS:
            defaults[key] = value
    return defaults


# Each flag's --help: what it means and what applies without it. The defaults are launch's: with neither the
# flag nor the config file, torchrun's own default, or for a training setting the script's own arguments.
FLAG_HELP = {
    "compute_environment": "this_machine or multi_node: whether `trainforge config` asks about the other "
    "machines (default: this_machine)",
    "nnodes": "number of machines, or MIN:MAX for an elastic job (default: PET_NNODES or SKYPILOT_NUM_NODES when "
    "set, else 1)",
    "node_rank": "this machine's rank, 0 .. nnodes-1; 0 is the one the others connect to (default: PET_NODE_RANK "
    "or SKYPILOT_NODE_RANK when set, else 0)",
    "master_addr": "address of the rank-0 machine (default: PET_MASTER_ADDR or the first of SKYPILOT_NODE_IPS "
    "when set, else 127.0.0.1)",
    "master_port": "port on the rank-0 machine (default: PET_MASTER_PORT when set; else on one machine a free "
    "port, with several 29500)",
    "rdzv_backend": "rendezvous backend: static, c10d, etcd or etcd-v2 (default: static)",
    "rdzv_endpoint": "rendezvous endpoint host:port of a c10d/etcd rendezvous (default: none)",
    "max_restarts": "how many times the whole group is restarted after a worker fails (default: 0)",
    "monitor_interval": "seconds between the launcher's checks of its workers (default: torchrun's, 0.1)",
    "shutdown_timeout": "seconds the workers get to save and exit after a stop signal, before SIGKILL "
    "(default: 30; needs torch >= 2.12)",
    "accelerator": "device type: auto, cpu or gpu (default: what the script passes, else auto: a GPU "
    "when there is one)",
    "nproc_per_node": "processes (ranks) per machine, usually one per GPU (default: PET_NPROC_PER_NODE or "
    "SKYPILOT_NUM_GPUS_PER_NODE when set, else 1)",
    "strategy": "strategy for the script's Trainer or Accelerator: " + ", ".join(STRATEGY_NAMES) + " (default: "
    "what the script passes, else auto)",
    "deepspeed.zero_stage": "DeepSpeed ZeRO stage 0-3, with --strategy deepspeed (default: 2)",
    "deepspeed.offload_optimizer_device": "DeepSpeed: offload optimizer state to none, cpu or nvme (default: none)",
    "deepspeed.offload_param_device": "DeepSpeed ZeRO-3: offload parameters to none, cpu or nvme (default: none)",
    "fsdp.sharding_strategy": "FSDP sharding: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD "
    "(default: FULL_SHARD)",
    "precision": "precision: " + ", ".join(PRECISIONS) + " (default: what the script passes, else 32)",
    "gradient_accumulation_steps": "batches whose gradients are summed before each optimizer step (default: "
    "what the script passes, else 1)",
    "activation_checkpointing": "activation memory: none, full, selective:<n>, op or offload, for every "
    "strategy (default: what the script passes, else none)",
}


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (shared by `config` and `launch`); values are checked later, by Setting."""
    group = parser.add_argument_group("settings (override the config file)")
    for setting in SETTINGS:
        group.add_argument(setting.flag, dest=setting.dest, default=None, metavar="VALUE", help=FLAG_HELP[setting.key])


def strategy_kwargs(strategy: str, defaults: Mapping[str, Any]) -> Dict[str, Any]:
    """Constructor arguments for the strategy named ``strategy`` from the launch settings: the
    ``activation_checkpointing`` every strategy takes, then its ``deepspeed``/``fsdp``/``megatron``
    section (the config file speaks HF Accelerate's words; the strategy classes take their own
    argument names; a section's own value wins)."""
    common = {}
    if defaults.get("activation_checkpointing") is not None:
        common["activation_checkpointing"] = defaults["activation_checkpointing"]
    return {**common, **_section_kwargs(strategy, defaults)}


def _section_kwargs(strategy: str, defaults: Mapping[str, Any]) -> Dict[str, Any]:
    section = defaults.get(strategy)
    if not isinstance(section, Mapping):
        return {}
    if strategy == "fsdp":
        kwargs: Dict[str, Any] = {}
        if "sharding_strategy" in section:
            kwargs["sharding_strategy"] = str(section["sharding_strategy"]).lower()
        return kwargs
    if strategy == "deepspeed":
        kwargs = {}
        if "zero_stage" in section:
            kwargs["stage"] = int(section["zero_stage"])
        devices = {section.get("offload_optimizer_device", "none"), section.get("offload_param_device", "none")}
        kwargs["offload_optimizer"] = section.get("offload_optimizer_device", "none") != "none"
        kwargs["offload_parameters"] = section.get("offload_param_device", "none") != "none"
        if "nvme" in devices:
            kwargs["offload_device"] = "nvme"
        return kwargs
    if strategy == "megatron":
        unknown = sorted(set(section) - set(MEGATRON_KEYS))
        if unknown:
            raise ConfigurationError(
                f"megatron.{unknown[0]} is not a MegatronStrategy setting; valid keys: {', '.join(MEGATRON_KEYS)}"
            )
        return dict(section)
    return {}
