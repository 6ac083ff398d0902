"""``TrainingModule``, ``DataModule`` and their hyperparameters."""
