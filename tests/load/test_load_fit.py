"""A load fitted into the engines' context (issue 41): the prompts drawn fit it by a bound that
holds for any byte-level tokenizer, and a context nothing fits is one error before anything is sent."""

from __future__ import annotations

import pytest

from bear.load.generator import PROMPT_SPECIAL_TOKENS, DoesNotFit, fits, make_queries
from bear.stack.stack import _option_int

MODELS = ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B")


def test_every_prompt_drawn_fits_the_context_and_the_rest_are_counted() -> None:
    qs, left_out = make_queries(120, 3, None, MODELS, 2048)
    assert len(qs) == 120 and left_out > 0  # the mix's long documents do not fit 2,048 tokens
    assert all(len(q.prompt.encode()) + PROMPT_SPECIAL_TOKENS < 2048 for q in qs)
    assert len({q.query_id for q in qs}) == 120


def test_a_context_that_holds_everything_draws_the_unbounded_load() -> None:
    free, none_out = make_queries(60, 5, None, MODELS)
    roomy, left_out = make_queries(60, 5, None, MODELS, 10**9)
    assert none_out == left_out == 0
    assert [q.prompt for q in free] == [q.prompt for q in roomy]
    assert [q.target_s for q in free] == [q.target_s for q in roomy]


def test_a_context_nothing_fits_says_so() -> None:
    with pytest.raises(DoesNotFit, match=r"0 of 10 prompts .* fit a 20-token context"):
        make_queries(10, 0, None, MODELS, 20)


@pytest.mark.parametrize(("prompt", "context", "ok"), [
    ("x" * 100, None, True), ("x" * 100, 117, True), ("x" * 100, 116, False), ("é" * 50, 116, False)])
def test_fits_counts_utf8_bytes_and_special_tokens(prompt: str, context: int | None, ok: bool) -> None:
    assert fits(prompt, context) is ok


@pytest.mark.parametrize(("args", "value"), [
    (["--max-model-len", "2048", "--max-num-seqs", "8"], 2048), (["--max-model-len=4096"], 4096),
    (["--max-model-len", "1", "--max-model-len=3"], 3), (["--max-num-seqs", "8"], None),
    (["--max-model-len"], None), (["--max-model-len", "auto"], None)])
def test_option_int_reads_vllm_arguments(args: list[str], value: int | None) -> None:
    assert _option_int(args, "--max-model-len") == value
