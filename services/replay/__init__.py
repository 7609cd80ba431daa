"""Offline replay: a recorded run (the snapshotter's ``--record-to`` step log) turned into replay
cases (``recorded_run``, with the prefix cache and the block pool as they were at each step:
``recorded_cache``, ``recorded_pool``), and replay cases run through libbea (``cases``). The tools
of ``bear record``, ``bear estimate --cases``, ``bear calibrate --cases``, the benchmarks and the
tests; no process beside vLLM or on the query path imports them."""
