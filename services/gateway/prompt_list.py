"""A completions request whose prompt is not one string — a list of prompts, token ids, or a list
of token-id lists — answered as vLLM answers it: one response whose choices are every prompt's
(prompt ``i``'s ``j``-th sequence at index ``i·n + j``), the usage summed.

Each prompt is routed as its own query: vLLM itself splits such a request into one engine request
per prompt, so a query per prompt is what the engines see, and each gets its own estimate and its
own instance (a batch of scoring prompts spreads over the pool instead of queueing on one engine).
Their answers are merged as they arrive: streamed, every chunk goes out as soon as it comes, with
its choices' indices moved to the prompt's; unstreamed, the choices are merged whole
(``merge_choices``). The first failure fails the whole request — the other prompts' queries are
cancelled — as vLLM fails a request whose prompt is refused. A token-id prompt reaches its engine
as ids (``bear.submit/1`` ``prompt_ids``), its length exact; its text, for the predictor, is the
ids decoded with the model's registered tokenizer where there is one (else empty)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from msgspec import UNSET

from bear.gateway.openai_types import Submission
from bear.gateway.openai_wire import ApiError, merge_choices
from bear.protocol.replies import Chunk, Done, Error, Reply, Routed


@dataclasses.dataclass
class PromptAnswer:
    """What came back for one prompt so far."""

    index: int
    routed: Routed | None = None
    done: Done | None = None
    relayed: bool = False  # its chunks carried the engine's choices (with their finish reasons)


def one_prompt(sub: Submission, prompt: str | list[int], text: str) -> Submission:
    """The submission of one prompt of the list (``text``: a token-id prompt's text, for the predictor)."""
    if isinstance(prompt, str):
        return dataclasses.replace(sub, prompt=prompt, prompts=None)
    return dataclasses.replace(sub, prompt=text, prompts=None, prompt_ids=prompt)


def choices_of(m: Chunk, base: int) -> list[Any]:
    """A chunk's choices as the merged answer numbers them: the engine's, their indices moved by
    ``base`` (the prompt's first index), or the router's text as the prompt's one choice."""
    if m.choices is UNSET:
        return [{"index": base, "text": m.text or "", "logprobs": None, "finish_reason": None}]
    out = []
    for c in m.choices or []:
        if isinstance(c, dict):
            c = {**c, "index": base + int(c.get("index", 0))}
        out.append(c)
    return out


def usage_sum(dones: list[Done | None]) -> dict[str, int]:
    """The prompts' usages added up (vLLM's usage of a list request)."""
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for d in dones:
        u = (d.usage if d is not None else None) or {}
        for k in total:
            v = u.get(k)
            if isinstance(v, int):
                total[k] += v
    total["total_tokens"] = max(total["total_tokens"], total["prompt_tokens"] + total["completion_tokens"])
    return total


async def merged(streams: list[AsyncIterator[Reply]]) -> AsyncIterator[tuple[int, Reply]]:
    """Every stream's messages as ``(stream index, message)`` in the order they arrive; closing
    the iterator (or leaving it) cancels the streams still running and closes them."""
    # (i, message), or (i, None) when stream i ended, or (i, exc) when it failed: the pump hands
    # its failure over itself (a task's exception read after its end marker may not be set yet)
    queue: asyncio.Queue[tuple[int, Reply | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[Reply]) -> None:
        end: BaseException | None = None
        try:
            async with contextlib.aclosing(it):  # type: ignore[type-var]
                async for m in it:
                    await queue.put((i, m))
        except Exception as exc:
            end = exc
        finally:
            queue.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    open_ = len(tasks)
    try:
        while open_:
            i, m = await queue.get()
            if isinstance(m, BaseException):
                raise m
            if m is None:
                open_ -= 1
                continue
            yield i, m
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PromptListAnswer:
    """The answer of a list of prompts: fed each prompt's messages (``feed``), it yields the bytes
    to stream, or keeps them for the one body; ``decisions`` is BEAR's ``bear`` field."""

    def __init__(self, n_prompts: int, sequences: int) -> None:
        self.prompts = [PromptAnswer(i) for i in range(n_prompts)]
        self.sequences = sequences
        self.kept: list[list[Any]] = []

    def base(self, i: int) -> int:
        return i * self.sequences

    def chunk(self, i: int, m: Chunk) -> list[Any]:
        p = self.prompts[i]
        p.relayed = p.relayed or m.choices is not UNSET
        return choices_of(m, self.base(i))

    def finish(self, i: int, m: Done) -> list[Any] | None:
        """The prompt's last choices: its finish reason, unless the engine's choices carried it."""
        p = self.prompts[i]
        p.done = m
        if p.relayed:
            return None
        return [{"index": self.base(i), "text": "", "logprobs": None, "finish_reason": m.finish_reason or "stop"}]

    @property
    def finished(self) -> bool:
        return all(p.done is not None for p in self.prompts)

    def usage(self) -> dict[str, int]:
        return usage_sum([p.done for p in self.prompts])

    def body_choices(self) -> list[dict[str, Any]]:
        return merge_choices(False, self.kept)


async def decode_ids(tokenizer: Callable[[], Awaitable[Any]], prompts: list[str | list[int]]) -> list[str]:
    """The text of each token-id prompt ("" for a text prompt, and for all when the model has no
    usable tokenizer: the predictor then predicts from the length alone). ``tokenizer``: the
    model's (``bear.tokenizer``'s loaded bundle), fetched once; the decoding runs off the loop."""
    if all(isinstance(p, str) for p in prompts):
        return [""] * len(prompts)
    try:
        tok = await tokenizer()
    except ApiError:
        return [""] * len(prompts)

    def text(p: list[int]) -> str:
        try:
            return str(tok.tokenizer.decode(p, skip_special_tokens=False))
        except Exception:  # ids beyond its vocabulary: the engine refuses them; predict from the length
            return ""

    def run() -> list[str]:
        return ["" if isinstance(p, str) else text(p) for p in prompts]

    return await asyncio.get_running_loop().run_in_executor(None, run)


def query_ids(n: int) -> tuple[str, list[str]]:
    """The answer's id and each prompt's query id (``<answer>-<i>``)."""
    base = os.urandom(16).hex()
    return base, [f"{base}-{i}" for i in range(n)]


__all__ = ["Error", "PromptListAnswer", "decode_ids", "merged", "one_prompt", "query_ids"]
