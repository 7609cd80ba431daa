"""The router's tokenizers: bundles fetched from the object store by id (once each, in the
background — a query never waits for a download: until its tokenizer is loaded its length is
estimated), and the prompt encoded once per tokenizer off the event loop.

Encoding runs in a small thread pool, off the router's loop, and re-uses the ids of text an
earlier prompt shared (``bear.tokenizer.chunks``): an 8k-token prompt costs tens of milliseconds
to encode in full, its new part well under one. Completions prompts
are encoded as vLLM encodes them (special tokens added by the tokenizer's post-processor), chat
messages through the bundle's chat template without added special tokens (``bear.tokenizer.chat``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from bear.tokenizer.bundle import BundleError, TokenizerBundle
from bear.tokenizer.chat import ChatError, render
from bear.tokenizer.chunks import ChunkedEncoder
from bear.tokenizer.store import get_bundle

log = structlog.get_logger("bear.tokenizer")

RETRY_S = 5.0  # a bundle that could not be fetched is tried again after this long
FETCH_TIMEOUT_S = 15.0  # a fetch that takes longer is abandoned (and retried)


@dataclass
class Loaded:
    bundle: TokenizerBundle
    tokenizer: Any  # tokenizers.Tokenizer
    chunked: ChunkedEncoder | None = None  # re-uses the ids of text an earlier prompt shared

    def encode(self, prompt: str | None, messages: Sequence[Mapping[str, Any]] | None,
               verify: Callable[[Callable[[], None]], None] | None = None) -> list[int] | None:
        """The token ids the engine will see; None when this cannot be known exactly.
        ``verify(job)``: where the occasional full re-encoding that checks the chunk cache runs."""
        if messages is not None:
            if self.bundle.chat_template is None:
                return None
            try:
                text = render(self.bundle.chat_template, messages, self.bundle.special_tokens)
            except ChatError:
                return None
            return self._encode(text, False, verify)
        return self._encode(prompt or "", True, verify)

    def _encode(self, text: str, specials: bool, verify: Any) -> list[int]:
        if self.chunked is not None:
            return self.chunked.encode(text, specials, verify=verify)
        return list(self.tokenizer.encode(text, add_special_tokens=specials).ids)


def load(bundle: TokenizerBundle, *, chunked: bool = True) -> Loaded:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(bundle.tokenizer_json.decode())
    except Exception as exc:  # the Rust side raises its own exception type
        raise BundleError(f"tokenizer.json does not load: {exc}") from exc
    return Loaded(bundle, tok, ChunkedEncoder(tok) if chunked else None)


class TokenizerCache:
    def __init__(self, nc: Any, bucket: str, *, threads: int = 2) -> None:
        self.nc = nc
        self.bucket = bucket
        self.loaded: dict[str, Loaded] = {}
        self._failed: dict[str, float] = {}  # id → monotonic time of the last failure
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bear-tokenize")

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
            bundle = await asyncio.wait_for(get_bundle(self.nc.jetstream(timeout=2.0), self.bucket, bid),
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

    async def encode(self, ids: Iterable[str], prompt: str | None,
                     messages: Sequence[Mapping[str, Any]] | None) -> dict[str, list[int]]:
        """The prompt's token ids for each loaded tokenizer among ``ids`` (one thread job)."""
        todo = [(bid, self.loaded[bid]) for bid in dict.fromkeys(ids) if bid in self.loaded]
        if not todo:
            return {}

        def run() -> dict[str, list[int]]:
            out = {}
            for bid, tok in todo:
                ids_ = tok.encode(prompt, messages, verify=self._pool.submit)
                if ids_ is not None:
                    out[bid] = ids_
            return out

        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    async def close(self) -> None:
        for t in list(self._loading.values()):
            t.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
