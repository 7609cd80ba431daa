"""The wire contract every BEAR service imports: subjects, msgpack codec, error codes,
deadlines and logging set-up (design.md §2, §3, §7). Nothing here talks to NATS by itself."""

from bear.protocol.codec import pack, unpack
from bear.protocol.deadline import Deadline
from bear.protocol.errors import BearError, ErrorCode, error_reply
from bear.protocol.subjects import Subjects

__all__ = ["BearError", "Deadline", "ErrorCode", "Subjects", "error_reply", "pack", "unpack"]
