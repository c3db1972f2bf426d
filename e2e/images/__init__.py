"""Ferry's container images built without Docker (see build.py and docs/images.md)."""
