"""The node-local weight cache (issue 17): `store.py`, one verified copy per
node of each artifact, keyed by its manifest digest. The node agent, its CSI
mount and the operator's side come next (docs/node-cache.md)."""
