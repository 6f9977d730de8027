import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tokenized corpora go to a per-session cache, never the user's."""
    monkeypatch.setenv("BEHEMOTH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
