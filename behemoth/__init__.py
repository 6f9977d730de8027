"""behemoth: train and serve PyTorch models larger than one device."""

from behemoth.errors import BehemothError

__version__ = "0.1.0"
__all__ = ["BehemothError", "__version__"]
