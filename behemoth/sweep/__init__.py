"""Sweeps: many trials of one base config (grid, list, random sample), each a normal `behemoth train` run in a run
directory of its own, run in sequence, concurrently on this machine's devices, or as Ray tasks; optionally pruned by
successive halving on validation loss; summarized as a leaderboard and one plot of every validation curve."""
