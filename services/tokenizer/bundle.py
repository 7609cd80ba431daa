"""A tokenizer bundle: everything a router needs to turn a query into the token ids an engine
will see — the ``tokenizer.json`` (loaded with ``tokenizers``, no model weights), the chat
template and the special tokens the template refers to. Its id is a digest of its content, so
models of one family that share a tokenizer share one bundle (and one load per router).

Read from a model directory as Hugging Face lays it out (what vLLM loads): ``tokenizer.json``,
``tokenizer_config.json`` (``chat_template``: a string, or a list of named templates of which
``default`` is used; the special tokens, plain or as AddedToken maps) and, when present,
``chat_template.jinja`` (which transformers prefers to the config's template).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bear.protocol import schemas

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
MAX_BUNDLE_BYTES = 64 * 1024 * 1024


class BundleError(ValueError):
    """A model directory without a usable tokenizer, or a malformed bundle."""


class _Wire(msgspec.Struct, kw_only=True):
    v: str = schemas.TOKENIZER
    tokenizer_json: bytes
    chat_template: str | None = None
    special_tokens: dict[str, str] = msgspec.field(default_factory=dict)


@dataclass(frozen=True)
class TokenizerBundle:
    tokenizer_json: bytes
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        """``tok-`` and the first 32 hex digits of the SHA-256 of the bundle's bytes."""
        return "tok-" + hashlib.sha256(self.to_bytes()).hexdigest()[:32]

    def to_bytes(self) -> bytes:
        specials = dict(sorted(self.special_tokens.items()))
        return msgspec.msgpack.encode(_Wire(tokenizer_json=self.tokenizer_json, chat_template=self.chat_template,
                                            special_tokens=specials))

    @classmethod
    def from_bytes(cls, data: bytes) -> TokenizerBundle:
        if len(data) > MAX_BUNDLE_BYTES:
            raise BundleError(f"tokenizer bundle of {len(data)} bytes exceeds {MAX_BUNDLE_BYTES}")
        try:
            w = msgspec.msgpack.decode(data, type=_Wire)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BundleError(f"malformed tokenizer bundle: {exc}") from exc
        return cls(w.tokenizer_json, w.chat_template, dict(w.special_tokens))


def _token_text(v: object) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def find_model_dir(name_or_path: str) -> Path | None:
    """The directory of a model as vLLM was given it: a local folder, or a Hugging Face repo id
    in the local HF cache (``$HF_HOME/hub/models--org--name/snapshots/<rev>``); None if absent."""
    p = Path(name_or_path).expanduser()
    if (p / "tokenizer.json").is_file():
        return p
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    snaps = home / "hub" / f"models--{name_or_path.replace('/', '--')}" / "snapshots"
    found = sorted(snaps.glob("*/tokenizer.json")) if snaps.is_dir() else []
    return found[-1].parent if found else None


def from_model_dir(path: str | Path) -> TokenizerBundle:
    d = Path(path)
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise BundleError(f"{d} has no tokenizer.json (a fast tokenizer is needed)")
    cfg: dict[str, object] = {}
    if (d / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BundleError(f"{d / 'tokenizer_config.json'}: {exc}") from exc
    template: str | None = None
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    else:
        t = cfg.get("chat_template")
        if isinstance(t, str):
            template = t
        elif isinstance(t, list):
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            template = named.get("default") if isinstance(named.get("default"), str) else None
    specials = {k: s for k in SPECIAL_KEYS if (s := _token_text(cfg.get(k))) is not None}
    return TokenizerBundle(tj.read_bytes(), template, specials)
