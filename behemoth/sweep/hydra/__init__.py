"""Hydra execution of a sweep (Nagrecha & Kumar): every trial cut into shards that fit a device budget, shards spilled
to host memory (or disk) while they do not run, and a scheduler that gives each free worker the ready shard of the trial
with the longest remaining time (docs/sweep.md, "Hydra")."""
