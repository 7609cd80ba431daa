"""The whole BEAR stack as child processes of one command (``bear up``, benchmarks, tests)."""
