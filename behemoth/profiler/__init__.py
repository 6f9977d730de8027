"""Measurement of real runs: the memory each rank holds and the time of a training step."""
