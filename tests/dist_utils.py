"""Test helpers for several gloo ranks on 127.0.0.1: the executor's own launcher."""

from executor.local_ranks import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
