"""Running inside schedulers and launchers: stop signals, SLURM requeue, self-launching, notebooks."""
