"""Ferry's worker: fetch, verify, shard and tensorize model weights, streaming."""

# A constant, not importlib.metadata: reading the installed metadata costs a
# tiny step's worker a fifth of its start-up. tests/test_packaging.py checks
# that it matches pyproject.toml.
__version__ = "0.1.0"
