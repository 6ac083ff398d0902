"""The Trainer and its loop: fit, evaluation, metric logging, manual optimization, the tuner."""
