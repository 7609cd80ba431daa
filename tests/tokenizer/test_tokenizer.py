"""Exact prompt tokens: chat conversations and plain prompts tokenised as vLLM tokenises them
(golden ids from the vLLM venv's transformers renderer, tests/tokenizer/make_golden.py), bundles
identified by content, fetched from the object store by routers and encoded off the loop."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import nats
import pytest

from bear.protocol.subjects import Subjects
from bear.protocol.token_ids import count, unpack
from bear.tokenizer.bundle import BundleError, TokenizerBundle, from_model_dir
from bear.tokenizer.cache import TokenizerCache, load
from bear.tokenizer.store import get_bundle, put_bundle
from bear.vllm_instance.tiny_model import write_tokenizer

from waiting import wait_until

GOLDEN = json.loads((Path(__file__).resolve().parent / "data" / "chat_golden.json").read_text())


def tiny_dir(tmp: Path, template: str | None = None, **extra: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    write_tokenizer(tmp)
    cfg = json.loads((tmp / "tokenizer_config.json").read_text())
    if template is not None:
        cfg["chat_template"] = template
    cfg.update(extra)
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: f"{c['template']}-{'chat' if 'messages' in c else 'prompt'}")
def test_ids_equal_vllms_renderer(case: dict, tmp_path: Path) -> None:
    tok = load(from_model_dir(tiny_dir(tmp_path, case["chat_template"], bos_token="<|endoftext|>")))
    if "messages" in case:
        assert tok.encode(None, case["messages"]) == case["ids"]
    else:
        assert tok.encode(case["prompt"], None) == case["ids"]


def test_unrenderable_chat_is_not_counted(tmp_path: Path) -> None:
    raising = next(c["chat_template"] for c in GOLDEN if c["template"] == "raise-on-bad-role")
    tok = load(from_model_dir(tiny_dir(tmp_path, raising)))
    assert tok.encode(None, [{"role": "narrator", "content": "x"}]) is None  # the template raised
    assert tok.encode(None, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]) is None
    no_template = load(TokenizerBundle(tok.bundle.tokenizer_json))
    assert no_template.encode(None, [{"role": "user", "content": "x"}]) is None


def test_bundle_identity_and_round_trip(tmp_path: Path) -> None:
    a = from_model_dir(tiny_dir(tmp_path / "a"))
    b = from_model_dir(tiny_dir(tmp_path / "b"))
    assert a.id == b.id and a.id.startswith("tok-")  # one family, one bundle
    c = from_model_dir(tiny_dir(tmp_path / "c", "{{ messages[0]['content'] }}"))
    assert c.id != a.id
    assert TokenizerBundle.from_bytes(a.to_bytes()) == a
    (tmp_path / "d").mkdir()
    (tmp_path / "nothing").mkdir()
    (tmp_path / "d" / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    d = from_model_dir(tiny_dir(tmp_path / "d"))
    assert d.chat_template == "J{{ messages[0]['content'] }}"  # the .jinja file wins, as in transformers
    with pytest.raises(BundleError):
        from_model_dir(tmp_path / "nothing")
    with pytest.raises(BundleError):
        TokenizerBundle.from_bytes(b"\x01garbage")


async def test_router_cache_fetches_by_id_and_encodes_off_loop(nats_server, tmp_path: Path) -> None:
    nc = await nats.connect(nats_server.url)
    bucket = Subjects().tokenizers_bucket
    bundle = from_model_dir(tiny_dir(tmp_path))
    bid = await put_bundle(nc.jetstream(), bucket, bundle)
    assert await put_bundle(nc.jetstream(), bucket, bundle) == bid  # idempotent
    assert await get_bundle(nc.jetstream(), bucket, "tok-missing") is None
    cache = TokenizerCache(nc, bucket)
    try:
        assert await cache.encode([bid], "hi", None) == {}  # not loaded yet: no exact count
        cache.want([bid, "tok-missing"])
        await wait_until(lambda: bid in cache.loaded, what="the bundle fetched")
        msgs = [{"role": "user", "content": "hello"}]
        got = await cache.encode([bid, "tok-missing"], None, msgs)
        assert {k: list(unpack(v)) for k, v in got.items()} == {bid: load(bundle).encode(None, msgs)}  # packed
        long = "word " * 8000
        ran = asyncio.Event()
        asyncio.get_running_loop().call_soon(ran.set)  # runs only if the loop turns during the encode
        ids = await cache.encode([bid], long, None)
        assert count(ids[bid]) == len(long.encode())  # byte-level tokenizer: one id per byte
        assert ran.is_set()  # the loop kept running while the prompt was encoded
        # the same document with a short new tail: encoded inline (no thread job), exactly
        jobs = 0
        submit = cache._pool.submit

        def counting(*a: object, **k: object) -> object:
            nonlocal jobs
            jobs += 1
            return submit(*a, **k)

        cache._pool.submit = counting  # type: ignore[method-assign]
        again = await cache.encode([bid], long + "and a question", None)
        assert list(unpack(again[bid])) == load(bundle).tokenizer.encode(long + "and a question").ids and jobs == 0
        fresh = await cache.encode([bid], "other " * 2000, None)  # 12k new characters: the thread pool
        assert count(fresh[bid]) == 12_000 and jobs == 1
    finally:
        await cache.close()
        await nc.close()


def test_chunked_encoding_equals_the_full_one_and_reuses_shared_text(tmp_path: Path) -> None:
    from bear.benchmarks.prefix import _prompts, write_bench_tokenizer
    from bear.tokenizer.chunks import ChunkedEncoder

    tok, vocab = write_bench_tokenizer(tmp_path / "bpe")
    ce = ChunkedEncoder(tok)
    assert ce.disabled is None
    prompts = _prompts(tok, vocab, 12, 4096, 3, seed=1)
    for p in prompts:
        assert ce.encode(p, False) == tok.encode(p, add_special_tokens=False).ids
    assert ce.hit_chars > 0.6 * ce.total_chars  # the shared documents were encoded once
    # a conversation: each turn resends the last (with Unicode and odd spacing in it)
    conv = "system: Ünïcode résumé  double  spaces\n\n" + " ".join(vocab[:900])
    for t in range(5):
        conv += f"\nuser {t}: don't stop " + " ".join(vocab[1000 + 50 * t:1050 + 50 * t])
        assert ce.encode(conv, False) == tok.encode(conv, add_special_tokens=False).ids


def test_prompts_are_encoded_only_through_batch_calls(tmp_path: Path) -> None:
    """tokenizers' single-text ``encode`` holds the GIL for the whole call (a thread-pool encoding
    then stalls the router's loop); its batch calls release it. The chunked encoder (first-seen
    prompts split at their cuts, repeated ones, the periodic verification) and the plain path
    must encode prompt text through them only — and get the same ids."""
    from bear.benchmarks.prefix import _prompts, write_bench_tokenizer
    from bear.tokenizer.chunks import ChunkedEncoder

    tok, vocab = write_bench_tokenizer(tmp_path / "bpe")

    class Watched:
        def __init__(self) -> None:
            self.single, self.batched = 0, 0

        def encode(self, text: str, add_special_tokens: bool = False):
            self.single += len(text) > 8  # the encoder's own probe of the post-processor is "a b"
            return tok.encode(text, add_special_tokens=add_special_tokens)

        def encode_batch_fast(self, texts: list[str], add_special_tokens: bool = False):
            self.batched += len(texts)
            return tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    w = Watched()
    ce = ChunkedEncoder(w, verify_every=2)
    assert ce.disabled is None
    checks: list[object] = []
    for p in _prompts(tok, vocab, 6, 4096, 2, seed=3):
        assert ce.encode(p, False, verify=checks.append) == tok.encode(p, add_special_tokens=False).ids
    for job in checks:
        job()  # type: ignore[operator]
    assert checks and ce.disabled is None
    assert w.single == 0 and w.batched > 6


def test_chunking_turns_itself_off_for_a_tokenizer_it_would_get_wrong() -> None:
    from bear.tokenizer.chunks import ChunkedEncoder

    class Merging:  # one token per pair of characters, across spaces: chunk splits would differ
        def encode(self, text: str, add_special_tokens: bool = False):
            class E:
                pass

            e = E()
            e.ids = [ord(text[i]) * 1000 + (ord(text[i + 1]) if i + 1 < len(text) else 0)
                     for i in range(0, len(text), 2)]
            e.offsets = [(i, min(i + 2, len(text))) for i in range(0, len(text), 2)]
            return e

        def encode_batch(self, texts: list[str], add_special_tokens: bool = False):
            return [self.encode(t, add_special_tokens) for t in texts]

    ce = ChunkedEncoder(Merging())
    assert ce.disabled is not None
    text = "ab " * 1000
    assert ce.encode(text, False) == Merging().encode(text).ids


def test_shared_cuts_are_the_walks_own_cuts() -> None:
    """The lookup's rule: the leading cuts of an earlier prompt that a new one repeats (text up to
    just past each) are exactly the new prompt's own first cuts — checked against the walk."""
    import random

    from bear.tokenizer.chunks import ChunkedEncoder, Seen

    rng = random.Random(11)
    walker = ChunkedEncoder.__new__(ChunkedEncoder)
    alphabet = "ab Z  ,.9_\n-é"
    for trial in range(300):
        walker.stride = (1, 3, 16, 64)[trial % 4]
        old = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 1500)))
        keep = rng.randrange(0, len(old) + 1)
        new = old[:keep] + "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300)))
        seen = Seen(old, walker._boundaries(old), [], b"")
        want = max([k for k in range(len(seen.cuts) + 1)
                    if k == 0 or new[:seen.cuts[k - 1] + 2] == old[:seen.cuts[k - 1] + 2]])
        for beat in range(want + 1):
            assert walker._shared(new, seen, beat) == want, (trial, beat)
        assert walker._shared(new, seen, want + 1) == want + 1  # nothing better than the best so far
        assert walker._boundaries(new)[:want] == seen.cuts[:want]
        if want:
            start = seen.cuts[want - 1]
            assert seen.cuts[:want] + walker._boundaries(new, start) == walker._boundaries(new)


def test_chunked_encoder_memory_is_bounded(tmp_path: Path) -> None:
    """Past ``max_chars`` the least recently used keys go; the documents' own entries, used by
    every lookup, stay, so their text is still shared."""
    from bear.benchmarks.prefix import _prompts, write_bench_tokenizer
    from bear.tokenizer.chunks import ChunkedEncoder

    tok, vocab = write_bench_tokenizer(tmp_path / "bpe")
    ce = ChunkedEncoder(tok, max_chars=150_000, per_key=1)
    prompts = _prompts(tok, vocab, 12, 2048, 4, seed=3)
    for p in prompts:
        assert ce.encode(p, False) == tok.encode(p, add_special_tokens=False).ids
        assert ce.held_chars == sum(len(s.text) for g in ce.seen.values() for s in g) <= 150_000
        assert all(len(g) == 1 for g in ce.seen.values())
    assert sum(len(p) for p in prompts) > 150_000 > ce.held_chars  # some were let go
    assert ce.hit_chars > 0.5 * ce.total_chars  # the four documents still shared within the bound


def test_conversations_sharing_a_system_prompt_find_their_own_last_turn(tmp_path: Path) -> None:
    """Many conversations under one long system prompt (more than the prompts kept per key): each
    new turn reuses its own conversation's last turn, not only the system prompt."""
    from bear.benchmarks.prefix import write_bench_tokenizer
    from bear.tokenizer.chunks import ChunkedEncoder

    tok, vocab = write_bench_tokenizer(tmp_path / "bpe")
    ce = ChunkedEncoder(tok, per_key=2)
    system = "system: " + " ".join(vocab[:600])
    convs = [system + f" user {c}: " + " ".join(vocab[700 + 97 * c:1000 + 97 * c]) for c in range(10)]
    for c in range(10):
        ce.encode(convs[c], False)
    for turn in range(3):
        for c in range(10):
            convs[c] += f" reply {turn}: " + " ".join(vocab[2000 + 31 * c + turn:2060 + 31 * c + turn])
            h0 = ce.hit_chars
            assert ce.encode(convs[c], False) == tok.encode(convs[c], add_special_tokens=False).ids
            assert len(convs[c]) - (ce.hit_chars - h0) < 1500, (turn, c)  # only the new reply was encoded


def _chat_turns(vocab: list[str], rng_seed: int, turns: int) -> list[tuple[list[dict[str, str]], str]]:
    """A conversation behind a long system prompt: (the messages sent at each turn, the answer)."""
    import random

    rng = random.Random(rng_seed)
    words = lambda n: " ".join(rng.choice(vocab) for _ in range(n))  # noqa: E731
    msgs = [{"role": "system", "content": "You answer from this manual. " + words(1500)}]
    out = []
    for t in range(turns):
        msgs = [*msgs, {"role": "user", "content": f"question {t}: " + words(60)}]
        answer = f"answer {t}: " + words(200)  # LMSYS-Chat-1M: 69.5 user and 214.5 answer tokens per turn
        out.append((msgs, answer))
        msgs = [*msgs, {"role": "assistant", "content": answer}]
    return out


def test_a_primed_answer_leaves_the_next_turn_only_its_new_message(tmp_path: Path) -> None:
    """``Loaded.prime``: with the last answer encoded ahead, each turn encodes about its own user
    message (the text after the answer's last cut); without, the whole answer too. The ids are
    the full encoding's either way."""
    from bear.benchmarks.prefix import write_bench_tokenizer

    _, vocab = write_bench_tokenizer(tmp_path / "bpe")
    bundle = from_model_dir(tmp_path / "bpe")
    primed, plain = load(bundle), load(bundle)
    full = load(bundle, chunked=False)
    new_chars: dict[str, list[int]] = {"primed": [], "plain": []}
    for msgs, answer in _chat_turns(vocab, 5, 5):
        for name, tok in (("primed", primed), ("plain", plain)):
            ce = tok.chunked
            assert ce is not None
            n0, h0 = ce.total_chars, ce.hit_chars
            assert tok.encode(None, msgs) == full.encode(None, msgs)
            new_chars[name].append((ce.total_chars - n0) - (ce.hit_chars - h0))
        assert primed.prime(None, msgs, answer)
    user = 60 * 12  # a user message's characters, generously
    assert all(n < user + 2 * 512 for n in new_chars["primed"][1:]), new_chars
    assert all(n > 1000 + user for n in new_chars["plain"][1:]), new_chars  # the answer encoded at the next turn
    # a completions prompt whose next one appends to it is primed the same way
    p = "You answer from this manual. " + " ".join(vocab[:1500])
    a = " and so " + " ".join(vocab[1500:1700])
    assert primed.prime(p, None, a)
    ce = primed.chunked
    assert ce is not None
    n0, h0 = ce.total_chars, ce.hit_chars
    assert primed.encode(p + a + " more", None) == full.encode(p + a + " more", None)
    assert (ce.total_chars - n0) - (ce.hit_chars - h0) < 2 * 512


def test_tokenizer_cache_primes_in_the_background_and_skips_when_busy(tmp_path: Path) -> None:
    from bear.benchmarks.prefix import write_bench_tokenizer
    from bear.tokenizer.cache import PRIME_PENDING

    _, vocab = write_bench_tokenizer(tmp_path / "bpe")
    cache = TokenizerCache(None, "unused")
    bid = cache.add(from_model_dir(tmp_path / "bpe"))
    (msgs, answer), (nxt, _) = _chat_turns(vocab, 7, 2)
    assert cache.prime("tok-none", None, msgs, answer) is None  # not loaded: nothing to do
    assert cache.prime(bid, None, msgs, answer) == "queued"
    cache._prime_pool.submit(lambda: None).result(timeout=30)  # the one thread has done the job before it
    ce = cache.loaded[bid].chunked
    assert ce is not None
    n0, h0 = ce.total_chars, ce.hit_chars
    ids = asyncio.run(cache.encode([bid], None, nxt))[bid]
    assert list(unpack(ids)) == load(from_model_dir(tmp_path / "bpe"), chunked=False).encode(None, nxt)
    assert (ce.total_chars - n0) - (ce.hit_chars - h0) < 60 * 12 + 2 * 512
    for _ in range(PRIME_PENDING):
        assert cache._prime_slots.acquire(blocking=False)
    assert cache.prime(bid, None, msgs, answer) == "skipped"
    assert cache.primed == {"queued": 1, "skipped": 1, "paused": 0}
    asyncio.run(cache.close())


def test_priming_pauses_where_no_next_turn_starts_from_it_and_resumes_where_one_does(tmp_path: Path) -> None:
    """``ChunkedEncoder.priming_pays``: a prime is a whole encoding that saves the next turn's
    latency, not CPU. Queries asked once each (a document, a new question) never start from
    their primed answer: after ``PRIME_JUDGED_AFTER`` primes priming pauses, but for one answer in
    ``PRIME_SAMPLE_EVERY``. Conversations that come back use their primes: priming resumes and
    stays on. The ids are the full encoding's throughout."""
    import random

    from bear.benchmarks.prefix import write_bench_tokenizer
    from bear.tokenizer.chunks import PRIME_JUDGED_AFTER, PRIME_SAMPLE_EVERY

    _, vocab = write_bench_tokenizer(tmp_path / "bpe")
    bundle = from_model_dir(tmp_path / "bpe")
    tok, full = load(bundle), load(bundle, chunked=False)
    ce = tok.chunked
    assert ce is not None
    rng = random.Random(3)
    doc = "Read this. " + " ".join(rng.choice(vocab) for _ in range(1500))
    asked = []
    for q in range(PRIME_JUDGED_AFTER + 3 * PRIME_SAMPLE_EVERY):  # one question each, never a next turn
        prompt = doc + f" question {q}: " + " ".join(rng.choice(vocab) for _ in range(40))
        assert tok.encode(prompt, None) == full.encode(prompt, None)
        asked.append(ce.priming_pays())
        if asked[-1]:
            assert tok.prime(prompt, None, " the answer " + " ".join(rng.choice(vocab) for _ in range(50)))
    assert all(asked[:PRIME_JUDGED_AFTER])  # judged only after enough primes
    late = asked[PRIME_JUDGED_AFTER + PRIME_SAMPLE_EVERY:]
    assert 1 <= sum(late) <= len(late) // PRIME_SAMPLE_EVERY + 1, asked  # paused but for the samples
    # conversations: every turn starts from the last one's primed answer
    convs = [(f"system {c}. " + doc, "") for c in range(4)]
    resumed = None
    for turn in range(4 * PRIME_SAMPLE_EVERY):
        c = turn % len(convs)
        head, answer = convs[c]
        prompt = head + answer + f" turn {turn}: " + " ".join(rng.choice(vocab) for _ in range(30))
        assert tok.encode(prompt, None) == full.encode(prompt, None)
        answer = " reply " + " ".join(rng.choice(vocab) for _ in range(50))
        if ce.priming_pays():
            resumed = turn if resumed is None else resumed
            tok.prime(prompt, None, answer)
            convs[c] = (prompt, answer)
        else:
            convs[c] = (prompt, answer)
    assert resumed is not None
    assert all(ce.priming_pays() for _ in range(2 * PRIME_SAMPLE_EVERY))  # back on, not sampled


def test_the_router_encodes_on_the_calling_thread_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """``encode_on_calling_thread``: TOKENIZERS_PARALLELISM set to false where unset, a value the
    user set kept (and reported as it is); the ids are the same either way."""
    from bear.benchmarks.prefix import write_bench_tokenizer
    from bear.tokenizer.chunks import PARALLELISM_ENV, encode_ids, encode_on_calling_thread

    tok, vocab = write_bench_tokenizer(tmp_path / "bpe")
    texts = [" ".join(vocab[k:k + 300]) for k in range(0, 3000, 300)]
    monkeypatch.setenv(PARALLELISM_ENV, "true")
    parallel = encode_ids(tok, texts, False)
    assert encode_on_calling_thread() is False and os.environ[PARALLELISM_ENV] == "true"
    monkeypatch.delenv(PARALLELISM_ENV)
    assert encode_on_calling_thread() is True and os.environ[PARALLELISM_ENV] == "false"
    assert encode_ids(tok, texts, False) == parallel


class _RacedStore:
    """An object store where another writer stores the same bundle between our look-up and our
    put, so that our put fails at its purge of the older chunks (an instance may not purge)."""

    def __init__(self, other_wins: bool) -> None:
        self.other_wins = other_wins
        self.stored = False

    async def get_info(self, name: str):
        from nats.js.errors import ObjectNotFoundError

        if not self.stored:
            raise ObjectNotFoundError
        return type("Info", (), {"deleted": False})()

    async def put(self, name: str, data: bytes) -> None:
        self.stored = self.other_wins
        raise TimeoutError("nats: timeout (permissions violation for $JS.API.STREAM.PURGE…)")


@pytest.mark.parametrize("other_wins", [True, False])
async def test_a_bundle_stored_by_another_instance_meanwhile_is_ours(tmp_path: Path, monkeypatch, other_wins) -> None:
    import bear.tokenizer.store as store

    fake = _RacedStore(other_wins)

    async def ensure(js, bucket):
        return fake

    monkeypatch.setattr(store, "ensure_store", ensure)
    bundle = from_model_dir(tiny_dir(tmp_path))
    if other_wins:
        assert await put_bundle(None, "b", bundle) == bundle.id
    else:  # nothing there after all: the failure is real
        with pytest.raises(TimeoutError):
            await put_bundle(None, "b", bundle)
