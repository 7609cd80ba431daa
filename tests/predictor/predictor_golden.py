"""The predictor's golden data files (tests/predictor/data): how their inputs are stored and what
is recorded for each input. ``make_golden.py`` writes them, the tests compare against them; both
use the functions here, so the comparison is exactly what was recorded.

prompt_golden.jsonl.gz: a header line, then one prompt a line: ``{"text": str}`` or, for long
prompts, ``{"runs": [[piece, times], ...]}`` (the prompt is the pieces repeated and joined), with
``"out"`` = ``prompt_outputs`` of the prompt.

model_golden.json.gz: a small model directory written by ``bear.predictor.train`` (``"model_dir"``:
file name → text), LightGBM boosters with NaN / zero missing types and a 45-category feature
(``"boosters"``: name → model text), feature rows with NaN, ±0, ±inf, values below LightGBM's zero
threshold and out-of-range categories (``"rows"``: group → rows) with LightGBM's raw scores
(``"raw"``: group → booster name → scores), and the served reply of the model directory for
prompts of the prompt file (``"served"``: [prompt index, models, reply]).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from bear import libbea
from bear.predictor.features import analyse

DATA = Path(__file__).parent / "data"
PROMPT_FILE = DATA / "prompt_golden.jsonl.gz"
MODEL_FILE = DATA / "model_golden.json.gz"
PROMPT_FORMAT = "bear.predictor.prompt-golden/1"
MODEL_FORMAT = "bear.predictor.model-golden/1"


def digest(a: np.ndarray) -> str:
    """A 48-bit digest of an array's bytes: any change of any element changes it."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:12]


def prompt_text(rec: dict[str, Any]) -> str:
    if "text" in rec:
        return str(rec["text"])
    return "".join(piece * int(times) for piece, times in rec["runs"])


def prompt_outputs(text: str) -> dict[str, Any]:
    """What the prompt analysis yields for ``text``: the counts, the 64-bit piece hashes of the
    hashed window (digest), the signed 512-bucket vector (digest) and the scalar features
    (n_pieces, n_chars, n_sentences, chars/piece, limit_words, brief, detailed, task_*), exactly."""
    a = analyse(text)
    hashes, n_pieces, n_sentences = libbea.prompt_piece_hashes(text)
    assert a.hashed.dtype == np.float64 and hashes.dtype == np.uint64
    assert (n_pieces, n_sentences) == (a.n_pieces, a.scalars[2]), "two calls, one analysis"
    return {
        "n_pieces": int(a.n_pieces),
        "n_hashed": len(hashes),
        "hashes": digest(hashes.astype("<u8")),
        "vector": digest(a.hashed.astype("<f8")),
        "scalars": [float(x) for x in a.scalars],
    }


def read_prompts() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with gzip.open(PROMPT_FILE, "rt", encoding="ascii") as f:
        header = json.loads(f.readline())
        return header, [json.loads(line) for line in f]


def write_gz(path: Path, lines: list[str]) -> None:
    # mtime=0: the same content gives the same bytes.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write("".join(line + "\n" for line in lines).encode("ascii"))


def read_model() -> dict[str, Any]:
    with gzip.open(MODEL_FILE, "rt", encoding="ascii") as f:
        return json.load(f)


def write_model_dir(golden: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in golden["model_dir"].items():
        (out / name).write_text(text)
    return out
