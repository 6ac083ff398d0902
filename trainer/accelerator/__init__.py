"""The Accelerator (``prepare`` / ``backward`` / ``accumulate``) and the objects it hands back."""
