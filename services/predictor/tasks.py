"""The task families of the synthetic workload (bear.predictor.synth), by name: a module of its
own so that command-line help can list them without importing numpy."""

from __future__ import annotations

TASKS = ("alpaca", "hotpotqa", "govreport", "writingprompts")
