"""``lightning.pytorch.demos``: the demo language model (``Transformer``, ``WikiText2``, ``LightningTransformer``),
trainforge's own code with Lightning 2.6's arguments and numbers (trainer/compat/lightning/demos.py)."""

from trainforge.trainer.compat.lightning.demos import LightningTransformer, Transformer, WikiText2

__all__ = ["Transformer", "WikiText2", "LightningTransformer"]
