"""The run's fault-tolerance machinery: sealed checkpoints and their safe reader, refusals before launch, the local
and elastic launchers, restarts that resume from the newest intact checkpoint, and the test process helper."""
