"""HF Accelerate's names: configuration objects, state, trackers, helper functions, Accelerator arguments."""
