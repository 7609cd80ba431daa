"""Chat messages → the prompt text an engine tokenises, rendered as vLLM renders it: the model's
Jinja chat template in transformers' environment (``transformers.utils.chat_template_utils``:
a sandboxed environment with ``trim_blocks``/``lstrip_blocks`` and loop controls, a ``tojson``
filter that does not escape HTML, ``raise_exception`` and ``strftime_now``), the tokenizer's
special tokens as variables, ``add_generation_prompt=True`` (the OpenAI chat default vLLM
applies). Message contents are reduced to text as vLLM's ``string`` content format does: a list
of content parts becomes its text parts joined by newlines.

Not modelled (the count is then ``estimated``): tools, documents, multimodal parts, templates
that want the parts themselves (vLLM's ``openai`` content format), ``continue_final_message``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any


class ChatError(ValueError):
    """Messages this renderer cannot turn into the engine's exact prompt."""


@lru_cache(maxsize=64)
def compile_template(source: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatError(f"chat template does not compile: {exc}") from exc


def text_of(content: Any) -> str:
    """A message's content as text (vLLM's ``string`` content format)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, Mapping) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise ChatError("only text content parts can be counted exactly")
        return "\n".join(parts)
    raise ChatError("message content must be a string or a list of text parts")


def conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if m.get("tool_calls") or m.get("role") == "tool":
            raise ChatError("tool messages are not rendered here")
        role = m.get("role")
        if not isinstance(role, str):
            raise ChatError("every message needs a string role")
        msg: dict[str, Any] = {"role": role, "content": text_of(m.get("content"))}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def render(template: str, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str], *,
           add_generation_prompt: bool = True) -> str:
    """The prompt text of ``messages`` (ChatError when it cannot be rendered exactly)."""
    import jinja2

    try:
        return str(compile_template(template).render(
            messages=conversation(messages), tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **special_tokens))
    except jinja2.TemplateError as exc:
        raise ChatError(f"chat template failed: {exc}") from exc
