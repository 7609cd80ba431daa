"""Synthetic traffic: arrival processes, the paper's TTFT targets, and ``bear load``."""
