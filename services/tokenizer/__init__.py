"""Exact prompt tokens: tokenizer bundles (``bundle``) in the ``bear_tokenizers`` object store
(``store``), the one ``tokenizer.json`` loader (``loader``: the predictor's too), chat templates
rendered as vLLM renders them (``chat``), and the router's cache of loaded tokenizers that encodes
off the event loop (``cache``)."""
