"""Real Lightning programs with only their import lines changed (issue 20), at tiny sizes on synthetic
data; ``tests/trainer/test_lightning_programs.py`` runs them in-process."""
