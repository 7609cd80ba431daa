"""Read access to a typed message by its wire names, as on the maps the structs replaced: for code
that inspects messages generically (tests, logs, ``rep["error"]["code"]``)."""

from __future__ import annotations

from typing import Any

from msgspec import UNSET


class ByName:
    """``msg["instance"]``, ``msg.get("text", "")``, ``"nonce" in msg`` on a msgspec struct (``"v"``
    reads the tag; an unset field reads as absent)."""

    __slots__ = ()
    __struct_fields__: tuple[str, ...]

    def get(self, key: str, default: Any = None) -> Any:
        if key == "v":
            tag = getattr(self, "v", None)
            return default if tag is None else tag
        if key not in self.__struct_fields__:
            return default
        val = getattr(self, key)
        return default if val is UNSET else val

    def __getitem__(self, key: str) -> Any:
        val = self.get(key, UNSET)
        if val is UNSET:
            raise KeyError(key)
        return val

    def __contains__(self, key: str) -> bool:
        return self.get(key, UNSET) is not UNSET
