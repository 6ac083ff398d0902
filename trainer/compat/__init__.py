"""Compatibility layers: Lightning's and HF Accelerate's names and arguments, translated to trainforge's.

Names and argument translation only: behaviour lives in the core."""
