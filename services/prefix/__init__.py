"""Prefix caches of the instances, mirrored: vLLM's block hashing (``hashing``), one instance's
cached blocks from its KV events (``mirror``) and a prompt's hit at each instance (``hits``)."""
