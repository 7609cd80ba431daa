"""The one tokenizer loader: a ``tokenizer.json`` (a file, or its bytes from a bundle) as a
``tokenizers.Tokenizer``. The router's bundles (``cache``) and the predictor's token counts
(``bear.predictor.tokens``) both load through it, so both count a prompt with the same tokenizer
built the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bear.tokenizer.bundle import BundleError


def load_tokenizer(source: Path | bytes) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` path or its bytes; ``BundleError``
    (a ``ValueError``) when the file cannot be read or does not load."""
    from tokenizers import Tokenizer  # the Rust extension: loaded only where a tokenizer is

    try:
        data = source.read_bytes() if isinstance(source, Path) else source
        return Tokenizer.from_str(data.decode())
    except Exception as exc:  # OSError, UnicodeDecodeError, and the Rust side's own exception type
        raise BundleError(f"tokenizer.json does not load: {exc}") from exc
