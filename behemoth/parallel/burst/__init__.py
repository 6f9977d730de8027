"""Burst parallelism's runtime (DeepPool): each layer on its own data-parallel sub-mesh, the first `widths[l]` ranks,
activations re-sharded along the batch between layers of different widths, gradients summed within each layer's group."""

from behemoth.parallel.burst.groups import BurstGroups, batch_rows
from behemoth.parallel.burst.reshard import Rows, reshard
from behemoth.parallel.burst.runtime import BurstModel, check_widths

__all__ = ["BurstGroups", "BurstModel", "batch_rows", "Rows", "check_widths", "reshard"]
