"""Malformed snapshots never crash the process: a ValueError naming the field, or a valid parse."""

from __future__ import annotations

import copy
import random

import msgpack
import pytest

from bear import libbea

from bea_helpers import decoding, req, snapshot


def valid() -> dict:
    return snapshot([decoding("A", 100, 3), req("X", 500, c=100, blocks=7)], [req("W", 70)])


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("config"), "config"),
        (lambda d: d["config"].update(block_size=0), "config.block_size"),
        (lambda d: d["config"].update(policy="lifo"), "config.policy"),
        (lambda d: d["running"][0].update(computed_tokens=-1), "running[0].computed_tokens"),
        (lambda d: d["running"][1].update(prompt_tokens="many"), "running[1].prompt_tokens"),
        (lambda d: d["waiting"][0].pop("id"), "waiting[0].id"),
        (lambda d: d.update(free_blocks=10**12), "free_blocks"),
        (lambda d: d["running"][0].update(exclusive_blocks=99), "running[0].exclusive_blocks"),
        (lambda d: d["waiting"].append(dict(d["running"][0])), "duplicate request id"),
        (lambda d: d.update(running={}), "running"),
        (lambda d: d.update(schema="bear.snapshot/9"), "bear.snapshot/1"),
    ],
)
def test_errors_name_the_field(mutate, field) -> None:
    d = valid()
    mutate(d)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        libbea.Snapshot.from_dict(d)
    with pytest.raises(ValueError):
        libbea.Snapshot.from_msgpack(msgpack.packb(d))


def test_truncated_msgpack_is_rejected() -> None:
    data = msgpack.packb(valid())
    libbea.Snapshot.from_msgpack(data)
    for cut in range(0, len(data) - 1, 7):
        with pytest.raises(ValueError):
            libbea.Snapshot.from_msgpack(data[:cut])


def test_random_bytes_never_crash() -> None:
    rng = random.Random(7)
    base = msgpack.packb(valid())
    accepted = 0
    for _ in range(20_000):
        if rng.random() < 0.5:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        else:  # flip bytes of a valid message
            b = bytearray(base)
            for _ in range(rng.randint(1, 6)):
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            data = bytes(b)
        try:
            s = libbea.Snapshot.from_msgpack(data)
        except ValueError:
            continue
        accepted += 1
        try:
            libbea.estimate(s, {"prompt_tokens": 50, "max_tokens": 4}, beta=[1e-3, 0, 0, 0], max_steps=50_000)
        except ValueError:
            pass
    assert accepted > 0  # some mutations stay valid and are replayed


def _mutations(obj, rng):
    """Yield copies of obj with one randomly chosen leaf replaced by a hostile value."""
    hostile = [None, -1, 0, 2**62, -(2**62), 1.5, float("nan"), float("inf"), "x", [], {}, True, [1, 2]]
    paths = []

    def walk(o, path):
        if isinstance(o, dict):
            for k, v in o.items():
                walk(v, [*path, k])
        elif isinstance(o, list):
            for i, v in enumerate(o):
                walk(v, [*path, i])
        paths.append(path)

    walk(obj, [])
    for _ in range(3000):
        d = copy.deepcopy(obj)
        path = rng.choice(paths)
        if not path:
            continue
        target = d
        for p in path[:-1]:
            target = target[p]
        if rng.random() < 0.2 and isinstance(target, dict):
            target.pop(path[-1], None)
        else:
            target[path[-1]] = rng.choice(hostile)
        yield d


def test_random_dict_mutations_never_crash() -> None:
    rng = random.Random(11)
    for d in _mutations(valid(), rng):
        try:
            s = libbea.Snapshot.from_dict(d)
        except ValueError as e:
            assert str(e)
            continue
        libbea.estimate(s, {"prompt_tokens": 50, "max_tokens": 4}, beta=[1e-3, 0, 0, 0], max_steps=50_000)


def test_deep_nesting_and_bad_types() -> None:
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ValueError):
        libbea.Snapshot.from_dict({"config": deep})
    with pytest.raises(ValueError):
        libbea.Snapshot.from_msgpack(b"\x91" * 100 + b"\xc0")
    with pytest.raises(ValueError):
        libbea.Snapshot.from_dict({1: 2})
    with pytest.raises(ValueError):
        libbea.estimate(libbea.Snapshot.from_dict(valid()), {"prompt_tokens": 10**9})
    with pytest.raises(ValueError):
        libbea.estimate(libbea.Snapshot.from_dict(valid()), {"prompt_tokens": 10}, beta=[1, 2, 3])
