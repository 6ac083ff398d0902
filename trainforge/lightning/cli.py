"""``lightning.pytorch.cli``: ``LightningCLI`` on jsonargparse (trainer/compat/lightning/cli.py says what it takes)."""

from trainforge.trainer.compat.lightning.cli import LightningCLI, SaveConfigCallback

__all__ = ["LightningCLI", "SaveConfigCallback"]
