"""What the sim engine's answer looks like beyond placeholder words, so that the router's relay of
engine fields can be tested without a model: ``n`` choices, log-probabilities, a call of the tool
a named ``tool_choice`` (or ``required``) picks, and JSON for ``response_format`` json_object /
json_schema or ``structured_outputs.json``. Structured text is valid for its JSON schema (the
value ``instance_of`` builds) and ends the answer where guided decoding would (its own length, cut
at ``max_tokens`` like vLLM's). Timing stays the engine's: one piece of text per generated token."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

PIECE_CHARS = 4  # structured text goes out this many characters per token (≈ a BPE token)
LOGPROB = -0.25  # every generated token's log-probability (placeholder words have no model)
MAX_DEPTH = 32


class ShapeError(ValueError):
    """A request whose structured output cannot be built (an unknown tool, a bad schema)."""


@dataclass
class Shape:
    n: int = 1
    structured: str | None = None  # the whole text of a structured answer (JSON), else placeholder words
    tool: str | None = None  # a tool call's function name (``structured`` is its arguments)
    top_logprobs: int | None = None  # None: no log-probabilities; k: the token's and k alternatives

    def length(self, max_tokens: int) -> int | None:
        """A structured answer's length in tokens, cut at ``max_tokens`` (None: the engine's own)."""
        if self.structured is None:
            return None
        return max(1, min(max_tokens, -(-len(self.structured) // PIECE_CHARS)))

    def piece(self, k: int, filler: str) -> str:
        """The ``k``-th token's text (``filler``: the placeholder word of an unstructured answer)."""
        if self.structured is None:
            return filler
        return self.structured[k * PIECE_CHARS:(k + 1) * PIECE_CHARS]


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str):
        return schema
    node: Any = root
    for part in ref.removeprefix("#/").split("/") if ref.startswith("#/") else ():
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        raise ShapeError(f"schema reference {ref!r} does not resolve")
    return node


def instance_of(schema: Any, root: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """A value valid for the JSON schema ``schema`` (the subset structured outputs use: types,
    properties, items, enum, const, anyOf/oneOf/allOf, $ref, numeric and length bounds)."""
    if depth > MAX_DEPTH:
        raise ShapeError("schema nested too deeply")
    if schema is True or schema is None or schema == {}:
        return "lorem"
    if not isinstance(schema, dict):
        raise ShapeError("a JSON schema must be an object")
    root = root if root is not None else schema
    schema = _resolve(schema, root)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return instance_of(schema[key][0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((t for t in kind if t != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: instance_of(sub, root, depth + 1) for name, sub in props.items()}
    if kind == "array":
        n = max(1, int(schema.get("minItems", 1)))
        if isinstance(schema.get("maxItems"), int):
            n = min(n, schema["maxItems"])
        return [instance_of(schema.get("items", {}), root, depth + 1) for _ in range(n)]
    if kind == "string":
        text = "lorem"
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if isinstance(lo, int) and len(text) < lo:
            text = (text * (lo // len(text) + 1))[:lo]
        if isinstance(hi, int):
            text = text[:hi]
        return text
    if kind in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        v = 0 if lo is None else int(lo) + (1 if "exclusiveMinimum" in schema and "minimum" not in schema else 0)
        hi = schema.get("maximum")
        if isinstance(hi, int | float) and v > hi:
            v = int(hi)
        return v
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    raise ShapeError(f"unknown schema type {kind!r}")


def _tool_schema(tools: Any, name: str | None) -> tuple[str, Any]:
    if not isinstance(tools, list) or not tools:
        raise ShapeError("tool_choice needs tools")
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and (name is None or fn.get("name") == name):
            return str(fn.get("name")), fn.get("parameters") or {"type": "object", "properties": {}}
    raise ShapeError(f"tool_choice names {name!r}, which is not among the tools")


def shape_of(body: dict[str, Any], chat: bool) -> Shape:
    """The answer's shape from the request body's engine fields (ShapeError: not buildable)."""
    n = body.get("n") or 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ShapeError("n must be a positive integer")
    shape = Shape(n=n)
    lp = body.get("logprobs")
    if chat:
        if lp:
            shape.top_logprobs = int(body.get("top_logprobs") or 0)
    elif lp is not None and lp is not False:
        shape.top_logprobs = int(lp)
    choice = body.get("tool_choice") if chat else None
    if isinstance(choice, dict):
        fn = choice.get("function")
        shape.tool, schema = _tool_schema(body.get("tools"), fn.get("name") if isinstance(fn, dict) else None)
        shape.structured = json.dumps(instance_of(schema))
        return shape
    if choice == "required":
        shape.tool, schema = _tool_schema(body.get("tools"), None)
        shape.structured = json.dumps(instance_of(schema))
        return shape
    fmt = body.get("response_format")
    so = body.get("structured_outputs")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        js = fmt.get("json_schema") or {}
        shape.structured = json.dumps(instance_of(js.get("schema", js.get("json_schema", {}))))
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        shape.structured = "{}"
    elif isinstance(so, dict) and so.get("json") is not None:
        schema = so["json"]
        shape.structured = json.dumps(instance_of(json.loads(schema) if isinstance(schema, str) else schema))
    elif isinstance(so, dict) and isinstance(so.get("choice"), list) and so["choice"]:
        shape.structured = str(so["choice"][0])
    return shape


def chat_logprobs(text: str, k: int) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` of one token: its own and ``k`` alternatives."""
    b = list(text.encode())
    alts = [{"token": text, "logprob": LOGPROB, "bytes": b}] + [
        {"token": f"<alt{j}>", "logprob": LOGPROB - 1.0 - j, "bytes": list(f"<alt{j}>".encode())} for j in range(k - 1)]
    return {"content": [{"token": text, "logprob": LOGPROB, "bytes": b, "top_logprobs": alts[:k]}]}


def completion_logprobs(text: str, k: int, offset: int) -> dict[str, Any]:
    """The completions API's ``logprobs`` of one token at character ``offset``."""
    top = {text: LOGPROB, **{f"<alt{j}>": LOGPROB - 1.0 - j for j in range(k - 1)}}
    return {"tokens": [text], "token_logprobs": [LOGPROB], "top_logprobs": [top], "text_offset": [offset]}
