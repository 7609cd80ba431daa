"""BEAR: latency-aware routing for heterogeneous pools of vLLM instances.

The import package ``bear`` is laid out from the repository's ``services/`` folder:
``bear.protocol`` (wire contract shared by every service), ``bear.snapshotter``,
``bear.predictor``, ``bear.estimator``, ``bear.router``, the CLI ``bear.cli``, and the
compiled BEA core ``bear.libbea`` (built from ``libbea/``).
"""

__version__ = "0.1.0"
