"""Generation with a paged KV cache, continuous batching, sharded, offloaded and quantized inference, the server."""

from behemoth.inference.generate import CachePolicy, Completion, Generator, load
from behemoth.inference.sampling import SamplingParams

__all__ = ["CachePolicy", "Completion", "Generator", "SamplingParams", "load"]
