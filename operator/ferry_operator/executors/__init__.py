"""Executors run prepare steps: `local` (processes on the operator's host, the
embedded default) and `kubernetes` (Jobs)."""
