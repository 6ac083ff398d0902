"""Lightning's ``LightningCLI`` on `jsonargparse <https://pypi.org/project/jsonargparse/>`_ (``pip install
jsonargparse``, or ``trainforge[cli]``; imported only when a CLI is built): the command line of a training
script made from the signatures of the Trainer, the module and the datamodule.

::

    LightningCLI(MyModel, MyDataModule)        # in train.py
    python train.py fit --trainer.max_epochs 2 --model.lr 0.1 --data.batch_size 32
    python train.py fit --config cfg.yaml      # the same keys in YAML (several --config: later ones win)
    python train.py fit --print_config         # the full configuration as YAML, then exit
    python train.py test --ckpt_path best

Subcommands ``fit``, ``validate``, ``test`` and ``predict``, each with ``--config``, ``--print_config``,
``--seed_everything`` (default True: a random seed, written into the configuration; False: none; an int), the
Trainer's arguments under ``--trainer.*``, the module's under ``--model.*``, the datamodule's under ``--data.*``
and the Trainer method's own (``--ckpt_path``). Before the method runs, the configuration is saved as
``config.yaml`` in the logger's directory (else ``default_root_dir``), as Lightning's ``SaveConfigCallback`` does;
an existing file is an error unless ``save_config_kwargs={"overwrite": True}``. ``run=False`` parses without a
subcommand and builds ``cli.trainer``, ``cli.model`` and ``cli.datamodule`` for the script to use.

Parsing, config files, types and help are jsonargparse's; this module only lays out the groups Lightning lays
out and runs the method. Not supported (refused by name): ``subclass_mode_*``, ``--optimizer``/``--lr_scheduler``
(not added whatever ``auto_configure_optimizers`` says: the module's ``configure_optimizers`` is used, and the
parser refuses those options by name),
``parser_class`` and ``save_config_callback`` other than the default or None.
"""

from __future__ import annotations

import os
import random
from typing import Any, Dict, List, Optional, Type, Union

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.accelerator.seed import seed_everything
from trainforge.trainer.loop.trainer import Trainer
from trainforge.trainer.module.training_module import TrainingModule

SUBCOMMANDS = ("fit", "validate", "test", "predict")
# the method arguments that the CLI fills from the built objects, not from the command line
_FILLED = {"model", "train_dataloaders", "val_dataloaders", "dataloaders", "datamodule"}


def _jsonargparse() -> Any:
    try:
        import jsonargparse
    except ImportError:
        raise ConfigurationError(
            "LightningCLI parses the command line with the 'jsonargparse' package, which is not installed: "
            "pip install jsonargparse (or pip install 'trainforge[cli]')"
        ) from None
    return jsonargparse


class SaveConfigCallback(Callback):
    """Writes the parsed configuration as ``config.yaml`` when the Trainer's method starts (rank 0)."""

    def __init__(self, parser: Any, config: Any, config_filename: str = "config.yaml", overwrite: bool = False):
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite = config_filename, overwrite
        self._written = False

    def on_setup(self, trainer: Any, module: Any, stage: str) -> None:
        if self._written or not trainer.is_global_zero:
            return
        logger = trainer.logger
        directory = getattr(logger, "log_dir", None) or trainer.default_root_dir
        path = os.path.join(directory, self.config_filename)
        if os.path.exists(path) and not self.overwrite:
            raise ConfigurationError(
                f"LightningCLI: {path} already exists; it is not overwritten. Use another "
                "--trainer.default_root_dir, or LightningCLI(save_config_kwargs={'overwrite': True})"
            )
        os.makedirs(directory, exist_ok=True)
        # nulls kept (Lightning's file has them): jsonargparse 4.49 renamed skip_none to skip_unset
        version = tuple(int(v) for v in _jsonargparse().__version__.split(".")[:2] if v.isdigit())
        keep = "skip_unset" if version >= (4, 49) else "skip_none"
        self.parser.save(self.config, path, overwrite=self.overwrite, multifile=False, **{keep: False})
        self._written = True


class LightningCLI:
    """Lightning's ``LightningCLI`` (see the module docstring): builds the parser, parses ``args`` (None: the
    command line), seeds, instantiates the Trainer, the module and the datamodule, and runs the subcommand."""

    def __init__(
        self,
        model_class: Optional[Type[TrainingModule]] = None,
        datamodule_class: Optional[Type[Any]] = None,
        save_config_callback: Optional[Type[SaveConfigCallback]] = SaveConfigCallback,
        save_config_kwargs: Optional[Dict[str, Any]] = None,
        trainer_class: Type[Trainer] = Trainer,
        trainer_defaults: Optional[Dict[str, Any]] = None,
        seed_everything_default: Union[bool, int] = True,
        parser_kwargs: Optional[Dict[str, Any]] = None,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: Optional[List[str]] = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
    ) -> None:
        _check_supported(model_class, save_config_callback, subclass_mode_model, subclass_mode_data)
        self.auto_configure_optimizers = auto_configure_optimizers  # no --optimizer: see the module docstring
        self._parsers: Dict[Optional[str], Any] = {}
        self.jsonargparse = _jsonargparse()
        self.model_class, self.datamodule_class, self.trainer_class = model_class, datamodule_class, trainer_class
        self.trainer_defaults = dict(trainer_defaults or {})
        self.seed_everything_default = seed_everything_default
        self.save_config_callback, self.save_config_kwargs = save_config_callback, dict(save_config_kwargs or {})
        self.parser_kwargs = dict(parser_kwargs or {})
        self.parser = self._build_parser(run)
        self.config = self.parser.parse_args(args)
        self.subcommand: Optional[str] = self.config["subcommand"] if run else None
        own = self.config[self.subcommand] if run else self.config
        self._seed(own)
        self._instantiate(own)
        if run:
            self._run(own)

    # ---- the parser -----------------------------------------------------------------------------
    def _build_parser(self, run: bool) -> Any:
        if not run:
            return self._group_parser(None)
        parser = self.jsonargparse.ArgumentParser(**self.parser_kwargs)
        commands = parser.add_subcommands(required=True, dest="subcommand")
        for name in SUBCOMMANDS:
            commands.add_subcommand(name, self._group_parser(name), help=f"Runs Trainer.{name}")
        return parser

    def _group_parser(self, subcommand: Optional[str]) -> Any:
        ja = self.jsonargparse
        parser = ja.ArgumentParser(**self.parser_kwargs)
        parser.add_argument("-c", "--config", action=ja.ActionConfigFile, help="a YAML file of these arguments")
        parser.add_argument(
            "--seed_everything",
            type=Union[bool, int],
            default=self.seed_everything_default,
            help="True: a random seed (saved in the config); False: no seeding; or the seed",
        )
        parser.add_class_arguments(self.trainer_class, "trainer", instantiate=False, fail_untyped=False)
        if self.trainer_defaults:
            parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items()})
        parser.add_class_arguments(self.model_class, "model", fail_untyped=False)
        if self.datamodule_class is not None:
            parser.add_class_arguments(self.datamodule_class, "data", fail_untyped=False)
        if subcommand is not None:
            parser.add_method_arguments(self.trainer_class, subcommand, skip=_FILLED, fail_untyped=False)
        self._parsers[subcommand] = parser
        return parser

    # ---- building and running -------------------------------------------------------------------
    def _seed(self, config: Any) -> None:
        seed = config["seed_everything"]
        if seed is True:
            seed = random.randint(0, 2**32 - 1)
            config["seed_everything"] = seed  # saved as the seed used, as Lightning does
        if seed is not False:
            seed_everything(int(seed), workers=True)

    def _instantiate(self, config: Any) -> None:
        parser = self._parsers[self.subcommand]
        # jsonargparse 4.49 renamed instantiate_classes to instantiate
        built = (parser.instantiate if hasattr(parser, "instantiate") else parser.instantiate_classes)(config)
        self.model = built["model"]
        self.datamodule = built["data"] if self.datamodule_class is not None else None
        kwargs = dict(built["trainer"])
        callbacks = _as_list(kwargs.pop("callbacks", None))
        if self.save_config_callback is not None and self.subcommand is not None:
            callbacks.append(self.save_config_callback(parser, config, **self.save_config_kwargs))
        self.trainer = self.trainer_class(**kwargs, callbacks=callbacks or None)

    def _run(self, config: Any) -> None:
        method = getattr(self.trainer, str(self.subcommand))
        own = ("config", "seed_everything", "trainer", "model", "data", "__path__")
        extra = {k: v for k, v in config.as_dict().items() if k not in own}
        method(model=self.model, datamodule=self.datamodule, **extra)


def _as_list(callbacks: Any) -> List[Any]:
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def _check_supported(model_class: Any, save_config_callback: Any, subclass_model: bool, subclass_data: bool) -> None:
    if model_class is None or not (isinstance(model_class, type) and issubclass(model_class, TrainingModule)):
        raise ConfigurationError(
            f"LightningCLI(model_class={model_class!r}): pass the module's class, a subclass of TrainingModule "
            "(LightningModule), e.g. LightningCLI(MyModel, MyDataModule)"
        )
    if subclass_model or subclass_data:
        raise ConfigurationError(
            "LightningCLI(subclass_mode_model/subclass_mode_data=True) is not supported: pass the class to train "
            "(LightningCLI(MyModel, MyDataModule)); choose between classes in the script"
        )
    if save_config_callback is not None and not (
        isinstance(save_config_callback, type) and issubclass(save_config_callback, SaveConfigCallback)
    ):
        raise ConfigurationError(
            f"LightningCLI(save_config_callback={save_config_callback!r}) must be None or trainforge's "
            "SaveConfigCallback (a subclass of it)"
        )
