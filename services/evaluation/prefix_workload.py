"""The prefix experiment's workload: multi-turn chat sessions behind a shared system prompt,
with token ids (no tokenizer: ids are drawn, as the engine's block hashes only need them to be
the same where the text is), in the shape of published statistics of public chat datasets.

Sources (docs/prefix.md has the table):

* turns per conversation: LMSYS-Chat-1M, mean **2.0** (Zheng et al., "LMSYS-Chat-1M", ICLR 2024,
  Table 1); drawn geometric with that mean (the shape is not published);
* user tokens per turn: LMSYS-Chat-1M, mean **69.5** (Llama-2 tokenizer; same table); drawn
  lognormal with that mean and σ = 1 (shape: our choice), at least 4;
* a common system prompt of **500** tokens on every conversation and a per-conversation context
  (a document, a RAG result) on its first user turn, lognormal with mean **1,000**, at most
  **5,000** tokens: the defaults of vLLM's multi-turn benchmark generator (vllm-project/vllm,
  ``benchmarks/multi_turn/generate_multi_turn.json``);
* answers: the length the serving model really generates for the turn's query (the evaluation's
  per-model outputs, which the predictor predicts), so that the answer enters the next turn's
  prompt with the tokens the engine produced;
* think time between a turn's answer and the next turn: exponential. No dataset publishes it;
  the Mooncake conversation trace suggests a median of minutes (kvcache-ai/Mooncake
  ``FAST25-release``), scaled here to the length of a simulated run (mean ``think_s``);
* sessions start as a Poisson stream at ``rate / mean turns``, so queries arrive at ≈ ``rate``.

Each turn borrows one query of the evaluation's query set for everything but its prompt: its
true quality and output length per model and the predictor's view (accuracy, length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bear.evaluation.workload import QuerySet

VOCAB = 151_936  # Qwen3's vocabulary (the paper's pool shares one tokenizer)


@dataclass(frozen=True)
class ChatStats:
    mean_turns: float = 2.0  # LMSYS-Chat-1M
    user_tokens_mean: float = 69.5  # LMSYS-Chat-1M
    user_sigma: float = 1.0
    system_tokens: int = 500  # vLLM multi-turn generator: common prefix
    context_tokens_mean: float = 1000.0  # vLLM multi-turn generator: per-conversation prefix, lognormal
    context_tokens_max: int = 5000
    context_sigma: float = 0.5
    think_s: float = 10.0


@dataclass
class Turn:
    session: int
    turn: int
    query: int  # index into the query set
    user: list[int]  # this turn's new tokens (context + user message on the first turn)


@dataclass
class Session:
    start: float
    turns: list[Turn] = field(default_factory=list)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> float:
    return float(rng.lognormal(np.log(mean) - sigma * sigma / 2.0, sigma))


def sessions(qs: QuerySet, rate: float, seed: int, stats: ChatStats = ChatStats()) -> tuple[list[int], list[Session]]:
    """(the shared system prompt, the sessions): as many turns as the query set has queries."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, stats.system_tokens).tolist()
    out: list[Session] = []
    t, q, s = 0.0, 0, 0
    n = len(qs)
    p = 1.0 / stats.mean_turns
    while q < n:
        t += float(rng.exponential(stats.mean_turns / rate))
        sess = Session(start=t)
        for k in range(int(rng.geometric(p))):
            if q >= n:
                break
            n_user = max(4, round(_lognormal(rng, stats.user_tokens_mean, stats.user_sigma)))
            if k == 0:
                n_user += min(stats.context_tokens_max, round(_lognormal(rng, stats.context_tokens_mean,
                                                                          stats.context_sigma)))
            sess.turns.append(Turn(s, k, q, rng.integers(0, VOCAB, n_user).tolist()))
            q += 1
        out.append(sess)
        s += 1
    return system, out


def answer_tokens(seed: int, session: int, turn: int, n: int) -> list[int]:
    """The ids of an answer of ``n`` tokens (the same for a given turn whatever model gave it:
    only the length depends on the model)."""
    return np.random.default_rng([seed, session, turn, 7]).integers(0, VOCAB, n).tolist()
