"""The one tokenizer loader (bear.tokenizer.loader, issue 25): a tokenizer.json from a path or
its bytes loads the same tokenizer, and one that does not load is a BundleError either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from bear.tokenizer.bundle import BundleError, TokenizerBundle
from bear.tokenizer.cache import load
from bear.tokenizer.loader import load_tokenizer
from bear.vllm_instance.tiny_model import write_tokenizer

TEXT = "Hello world, how are you? Ünïcode too."


def test_path_and_bytes_load_the_same_tokenizer(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    a, b = load_tokenizer(path), load_tokenizer(path.read_bytes())
    assert a.to_str() == b.to_str()
    assert a.encode(TEXT).ids == b.encode(TEXT).ids and a.encode(TEXT).ids
    # the router's bundles load through it too
    assert load(TokenizerBundle(path.read_bytes()), chunked=False).tokenizer.to_str() == a.to_str()


@pytest.mark.parametrize("bad", [b"{not json", b"\xff\xfe", b"{}"])
def test_a_bad_tokenizer_json_is_a_bundle_error(bad: bytes, tmp_path: Path) -> None:
    with pytest.raises(BundleError):
        load_tokenizer(bad)
    (tmp_path / "tokenizer.json").write_bytes(bad)
    with pytest.raises(BundleError):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(BundleError):
        load(TokenizerBundle(bad))


def test_a_missing_file_is_a_bundle_error(tmp_path: Path) -> None:
    with pytest.raises(BundleError):
        load_tokenizer(tmp_path / "absent.json")
