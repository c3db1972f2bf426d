"""Compiled state (serving.compiledState): vLLM's compile caches harvested from a Ready serving pod and
restored, verified, into the next pods of the same configuration (state.py), and the `ferry compiled`
commands (cli.py)."""
