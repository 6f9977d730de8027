"""Models that know nothing of parallelism."""

from behemoth.models.gpt import GPT, PRESETS, GPTConfig, build_gpt
from behemoth.models.init import InitSpec, materialize

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_gpt", "InitSpec", "materialize"]
