"""``trainforge config``: the launch settings, asked or given as flags, written to one YAML file that
``trainforge launch`` reads (trainer/cli/launch_settings.py: the settings and their checks).

Precedence: built-in defaults < config file (``--config-file`` or the default file) < flags. The
default file is ``$XDG_CONFIG_HOME/trainforge/default_config.yaml`` (``~/.config/...`` without
XDG_CONFIG_HOME). ``launch`` writes the resolved settings to a temporary YAML file and exports its
path as ``TRAINFORGE_LAUNCH_CONFIG`` to the workers; ``launch_defaults()`` reads it back there, and
the Trainer/Accelerator use those values where the user's code set nothing.

File layout (every key optional)::

    compute_environment: this_machine      # or multi_node
    nnodes: 2                              # or "MIN:MAX" (elastic)
    node_rank: 0
    master_addr: 10.0.0.1
    master_port: 29500
    rdzv_backend: static                   # rdzv_endpoint, max_restarts, monitor_interval, shutdown_timeout too
    accelerator: auto                      # auto | cpu | gpu
    nproc_per_node: 8
    strategy: deepspeed                    # auto single ddp fsdp deepspeed
    precision: bf16-mixed                  # 32 16-mixed bf16-mixed bf16-true fp8
    gradient_accumulation_steps: 4
    deepspeed: {zero_stage: 3, offload_optimizer_device: cpu, offload_param_device: none}
    fsdp: {sharding_strategy: FULL_SHARD}
    megatron: {tensor_parallel_size: 2, data_parallel_size: auto}   # MegatronStrategy's own argument names
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, Mapping

from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.cli.launch_settings import (
    SETTINGS,
    Setting,
    add_setting_arguments,
    default_config_path,
    flags_given,
    save_config,
    validate,
)

HELP = "answer a few questions and write the launch config file"
MAX_ATTEMPTS = 3  # re-asks of one question before `config` gives up


def resolve_answers(
    given: Mapping[str, Any], interactive: bool, ask: Callable[[str], str] = input, say: Callable[[str], None] = print
) -> Dict[str, Any]:
    """Every applicable setting: given ones kept, others asked (``interactive``) or defaulted."""
    answers: Dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.key in given:
            answers[setting.key] = given[setting.key]
        elif setting.asked and setting.ask_if(answers):
            default = setting.default(answers) if callable(setting.default) else setting.default
            answers[setting.key] = _ask(setting, default, answers, ask, say) if interactive else default
    return validate(answers)


def _ask(
    setting: Setting, default: Any, answers: Mapping[str, Any], ask: Callable[[str], str], say: Callable[[str], None]
) -> Any:
    choices = getattr(setting.parse, "choices", None)
    prompt = setting.question + (f" [{'/'.join(choices)}]" if choices else "") + f" (default: {default}): "
    for _ in range(MAX_ATTEMPTS):
        try:
            reply = ask(prompt).strip()
        except EOFError:
            raise ConfigurationError(
                f"input ended before {setting.key!r} was answered; give the answers "
                f"as flags ({setting.flag} ...) with --non-interactive"
            ) from None
        try:
            value = setting.parse(setting.key, reply) if reply else default
            validate({**answers, setting.key: value})  # e.g. node_rank < nnodes: re-ask, not fail
            return value
        except ConfigurationError as error:
            say(f"  {error}")
    raise ConfigurationError(f"no valid answer for {setting.key!r} after {MAX_ATTEMPTS} tries")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-file", default=None, help=f"where to write (default: {default_config_path()})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--interactive", action="store_true", help="ask even when stdin is not a TTY")
    mode.add_argument(
        "--non-interactive",
        action="store_true",
        help="ask nothing: flags, then defaults (the default when stdin is not a TTY)",
    )
    add_setting_arguments(parser)


def run(args: argparse.Namespace) -> int:
    interactive = args.interactive or (not args.non_interactive and sys.stdin.isatty())
    settings = resolve_answers(flags_given(args), interactive)
    target = args.config_file or default_config_path()
    try:
        path = save_config(settings, target)
    except OSError as e:
        raise ConfigurationError(
            f"--config-file={str(target)!r} cannot be written ({e.strerror or e}: {e.filename}); give a path "
            f"in a directory you can write to"
        ) from None
    print(f"Wrote {path}:\n" + path.read_text(), end="")
    return 0
