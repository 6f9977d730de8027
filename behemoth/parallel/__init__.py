"""One module per parallel dimension, each exposing `apply_<dim>(model, mesh, ...)`."""
