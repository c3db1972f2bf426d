"""Ferry's worker: fetch, verify, shard and tensorize model weights, streaming."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ferry")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+local"
