"""`ferry load`: the serving side. In a serving pod's init container it verifies
the files this pod's ranks need against the artifact's manifest, reads them at
the disk's parallel bandwidth so vLLM's own reads hit the page cache (or copies
them to node-local disk), and reports the outcome as the pod condition
`ferry.dev/weights-loaded`, which the pod's readiness gate waits for.

- `selection`: which manifest entries a set of ranks needs;
- `reader`: the parallel read / hash / copy stage;
- `report`: the pod condition, through the API server;
- `run`: the command, composed of the three.
"""
