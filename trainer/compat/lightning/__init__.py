"""Lightning's Trainer arguments and attributes, mapped onto trainforge's."""
