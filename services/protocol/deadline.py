"""Absolute deadlines carried in every request (``deadline`` field, wall-clock seconds)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from bear.protocol.errors import BearError, ErrorCode


@dataclass(frozen=True)
class Deadline:
    """A wall-clock instant after which nobody should keep working on a request."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.time() + seconds)

    @classmethod
    def from_request(cls, req: dict[str, Any], default_s: float) -> Deadline:
        """The request's ``deadline`` (absolute seconds) or now + ``default_s``."""
        raw = req.get("deadline")
        if raw is None:
            return cls.after(default_s)
        if not isinstance(raw, int | float) or isinstance(raw, bool) or not math.isfinite(raw):
            raise BearError(ErrorCode.BAD_REQUEST, "deadline must be a finite number (epoch seconds)")
        return cls(float(raw))

    def remaining(self) -> float:
        return self.at - time.time()

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def check(self) -> None:
        if self.expired():
            raise BearError(ErrorCode.DEADLINE_EXCEEDED, "deadline passed before the work was done")

    def timeout(self, cap: float | None = None) -> float:
        """Seconds left (never negative), optionally capped: use as a request timeout."""
        left = max(0.0, self.remaining())
        return left if cap is None else min(left, cap)
