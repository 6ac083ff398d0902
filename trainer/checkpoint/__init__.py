"""What a checkpoint holds, on top of ``trainforge.strategies.checkpoint``'s directory format."""
