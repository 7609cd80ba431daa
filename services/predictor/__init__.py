"""Per-model accuracy, output length and cost predictors (paper §3, Appendix A.4).

Features are computed from the prompt alone (hashed tokens → PCA, lengths, indicators), LightGBM
heads predict quality and output length per candidate model, cost follows from per-token prices.
The ``bear.predict`` NATS service (``service.py``) serves them; ``docs/predictor.md`` is the manual.
"""
