"""Memory: the analytic estimator of model-state bytes per rank (offload tiers will live here too)."""
