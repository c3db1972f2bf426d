"""The node agent's CSI driver `cache.ferry.dev` (docs/node-cache.md)."""
