"""The router's tokenizers: bundles fetched from the object store by id (once each, in the
background — a query never waits for a download: until its tokenizer is loaded its length is
estimated), and the prompt encoded once per tokenizer.

Encoding re-uses the ids of text an earlier prompt shared (``bear.tokenizer.chunks``): an
8k-token prompt costs tens of milliseconds to encode in full, its new part well under one. A
prompt with little new text (``INLINE_NEW_CHARS``) is encoded on the router's loop — a hop to a
thread and back, and the GIL hand-over between them, cost more than that (measured:
docs/results/2026-12-01-prefix-cost.md) —, any other in a small thread pool, off the loop. The ids come back packed, as the estimate
request carries them (``bear.protocol.token_ids``). Completions prompts
are encoded as vLLM encodes them (special tokens added by the tokenizer's post-processor), chat
messages through the bundle's chat template without added special tokens (``bear.tokenizer.chat``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from bear.protocol.token_ids import pack, unpack
from bear.tokenizer.bundle import BundleError, TokenizerBundle
from bear.tokenizer.chat import ChatError, render
from bear.tokenizer.chunks import ChunkedEncoder, Deferred, encode_ids
from bear.tokenizer.loader import load_tokenizer
from bear.tokenizer.store import get_bundle

log = structlog.get_logger("bear.tokenizer")

INLINE_NEW_CHARS = 2048  # a prompt with at most this much text no earlier prompt shared is encoded inline
INLINE_MAX_CHARS = 131_072  # … when the whole prompt is at most this long (the chunk lookup scans all of it)
RETRY_S = 5.0  # a bundle that could not be fetched is tried again after this long
FETCH_TIMEOUT_S = 15.0  # a fetch that takes longer is abandoned (and retried)
PRIME_PENDING = 4  # answers waiting to be encoded ahead of their next turn; more are not primed


@dataclass
class Loaded:
    bundle: TokenizerBundle
    tokenizer: Any  # tokenizers.Tokenizer
    chunked: ChunkedEncoder | None = None  # re-uses the ids of text an earlier prompt shared

    def encode(self, prompt: str | None, messages: Sequence[Mapping[str, Any]] | None,
               verify: Callable[[Callable[[], None]], None] | None = None) -> list[int] | None:
        """The token ids the engine will see; None when this cannot be known exactly."""
        ids = self.encode_packed(prompt, messages, verify)
        return None if ids is None else list(unpack(ids))

    def encode_packed(self, prompt: str | None, messages: Sequence[Mapping[str, Any]] | None,
                      verify: Callable[[Callable[[], None]], None] | None = None,
                      max_new_chars: int | None = None) -> bytes | None:
        """``encode``, packed as the estimate request carries them (``bear.protocol.token_ids``).
        ``verify(job)``: where the occasional full re-encoding that checks the chunk cache runs;
        ``max_new_chars``: ``Deferred`` rather than encode more new text than this."""
        if messages is not None:
            if self.bundle.chat_template is None:
                return None
            try:
                text = render(self.bundle.chat_template, messages, self.bundle.special_tokens)
            except ChatError:
                return None
            return self._encode(text, False, verify, max_new_chars)
        return self._encode(prompt or "", True, verify, max_new_chars)

    def prime(self, prompt: str | None, messages: Sequence[Mapping[str, Any]] | None, answer: str) -> bool:
        """Encode what the next turn will most likely start with — this prompt and its answer
        (chat: the conversation with the answer as the assistant's turn, no generation prompt) —
        so that the chunk cache holds it when the client resends it: that turn then encodes only
        its new message. A wrong guess costs this encoding and nothing else (reuse needs the
        text to agree). False when there is nothing to gain (no chunk cache, or a prompt whose
        special tokens keep it out of the cache)."""
        ce = self.chunked
        if ce is None or ce.disabled is not None or not answer:
            return False
        if messages is not None:
            if self.bundle.chat_template is None:
                return False
            try:
                text = render(self.bundle.chat_template, [*messages, {"role": "assistant", "content": answer}],
                              self.bundle.special_tokens, add_generation_prompt=False)
            except ChatError:
                return False
            ce.prime_packed(text, False)
            return True
        if not ce.caches(True):
            return False
        ce.prime_packed((prompt or "") + answer, True)
        return True

    def _encode(self, text: str, specials: bool, verify: Any, max_new_chars: int | None) -> bytes:
        if self.chunked is not None:
            return self.chunked.encode_packed(text, specials, verify=verify, max_new_chars=max_new_chars)
        if max_new_chars is not None and len(text) > max_new_chars:
            raise Deferred
        return pack(encode_ids(self.tokenizer, [text], specials)[0])


def load(bundle: TokenizerBundle, *, chunked: bool = True) -> Loaded:
    tok = load_tokenizer(bundle.tokenizer_json)  # BundleError when it does not load
    return Loaded(bundle, tok, ChunkedEncoder(tok) if chunked else None)


class TokenizerCache:
    def __init__(self, nc: Any, bucket: str, *, threads: int = 2,
                 sources: Callable[[str], Iterable[str]] | None = None) -> None:
        self.nc = nc
        self.bucket = bucket
        self.sources = sources  # bundle id → the instances naming it (objects are named by their writer)
        self.loaded: dict[str, Loaded] = {}
        self._failed: dict[str, float] = {}  # id → monotonic time of the last failure
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bear-tokenize")
        # answers encoded ahead of the next turn: one thread, a few waiting at most (a guess is
        # worth less than a query's own encoding, which has the other pool)
        self._prime_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bear-prime")
        self._prime_slots = threading.BoundedSemaphore(PRIME_PENDING)
        self.primed = {"queued": 0, "skipped": 0, "paused": 0}

    def add(self, bundle: TokenizerBundle) -> str:
        """Use a bundle held locally (tests, the evaluation)."""
        self.loaded[bundle.id] = load(bundle)
        return bundle.id

    def want(self, ids: Iterable[str]) -> None:
        """Start fetching the bundles not loaded yet (returns at once)."""
        now = time.monotonic()
        for bid in ids:
            if not bid or bid in self.loaded or bid in self._loading or now - self._failed.get(bid, -RETRY_S) < RETRY_S:
                continue
            self._loading[bid] = asyncio.create_task(self._fetch(bid))

    async def _fetch(self, bid: str) -> None:
        try:
            names = list(self.sources(bid)) if self.sources is not None else []
            bundle = await asyncio.wait_for(get_bundle(self.nc.jetstream(timeout=2.0), self.bucket, bid, names),
                                            FETCH_TIMEOUT_S)
            if bundle is None:
                raise BundleError("not in the object store")
            if bundle.id != bid:
                raise BundleError(f"content is bundle {bundle.id}")
            self.loaded[bid] = await asyncio.get_running_loop().run_in_executor(self._pool, load, bundle)
            log.info("tokenizer_loaded", tokenizer=bid)
        except Exception as exc:
            self._failed[bid] = time.monotonic()
            log.warning("tokenizer_unavailable", tokenizer=bid, error=repr(exc), retry_s=RETRY_S)
        finally:
            self._loading.pop(bid, None)

    async def get(self, bid: str, timeout_s: float) -> Loaded | None:
        """The bundle ``bid``, fetched first if need be (waiting at most ``timeout_s``); None
        when it cannot be had (not in the store, does not load, too slow)."""
        self.want([bid])
        task = self._loading.get(bid)
        if task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
        return self.loaded.get(bid)

    async def run(self, job: Callable[[], Any]) -> Any:
        """``job`` in the encoding threads (off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, job)

    async def encode(self, ids: Iterable[str], prompt: str | None,
                     messages: Sequence[Mapping[str, Any]] | None) -> dict[str, bytes]:
        """The prompt's token ids for each loaded tokenizer among ``ids``, packed. Encoded inline
        when little of the prompt is new (a thread hop and the GIL hand-over cost more than
        that encoding: ``INLINE_NEW_CHARS``), else in one thread job."""
        todo = [(bid, self.loaded[bid]) for bid in dict.fromkeys(ids) if bid in self.loaded]
        if not todo:
            return {}

        out: dict[str, bytes | None] = {}
        size = len(prompt or "") + sum(len(str(m.get("content") or "")) for m in messages or ())
        if size <= INLINE_MAX_CHARS:
            for bid, tok in todo:  # inline: a repeated prefix costs its chunk lookup, a short new part
                with contextlib.suppress(Deferred):
                    out[bid] = tok.encode_packed(prompt, messages, verify=self._pool.submit,
                                                 max_new_chars=INLINE_NEW_CHARS)
        rest = [(bid, tok) for bid, tok in todo if bid not in out]

        def run() -> dict[str, bytes | None]:
            return {bid: tok.encode_packed(prompt, messages, verify=self._pool.submit) for bid, tok in rest}

        if rest:
            out.update(await asyncio.get_running_loop().run_in_executor(self._pool, run))
        return {bid: ids for bid, ids in out.items() if ids is not None}

    def prime(self, bid: str | None, prompt: str | None, messages: Sequence[Mapping[str, Any]] | None,
              answer: str) -> str | None:
        """Queue ``Loaded.prime`` for a finished answer (returns at once): "queued", "paused"
        (``ChunkedEncoder.priming_pays``: recent primes were rarely used), "skipped"
        (``PRIME_PENDING`` already waiting), or None (no such tokenizer loaded with a chunk cache)."""
        tok = self.loaded.get(bid or "")
        if tok is None or tok.chunked is None or not answer:
            return None
        if not tok.chunked.priming_pays():
            self.primed["paused"] += 1
            return "paused"
        if not self._prime_slots.acquire(blocking=False):
            self.primed["skipped"] += 1
            return "skipped"

        def run() -> None:
            try:
                tok.prime(prompt, messages, answer)
            except Exception as exc:  # a guess that fails costs nothing else
                log.debug("prime failed", error=repr(exc))
            finally:
                self._prime_slots.release()

        try:
            self._prime_pool.submit(run)
        except RuntimeError:  # shut down
            self._prime_slots.release()
            return None
        self.primed["queued"] += 1
        return "queued"

    async def close(self) -> None:
        for t in list(self._loading.values()):
            t.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._prime_pool.shutdown(wait=False, cancel_futures=True)
