"""Sharded, resumable data loading: the loader (loader), samplers (sampler), streams of an
IterableDataset (iterable), splitting inputs between processes (split), helpers (utils)."""
