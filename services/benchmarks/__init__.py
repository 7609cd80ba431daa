"""Benchmarks that print numbers (``bear bench <part>``): one module per benchmark
(``bear.benchmarks.router``, ``bear.benchmarks.estimator``, …). They sit above the parts they
measure and the stack they start; no part imports a benchmark."""
