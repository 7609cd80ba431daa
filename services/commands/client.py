"""``bear submit``: one query through the router from the shell."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import typer

from bear.commands.options import FIND_NATS, ClientNatsCreds, NatsUrl, Prefix, positive
from bear.protocol.codec import json_safe
from bear.runtime import aio

SIMULATED_NOTE = "simulated instance: the text is placeholder (lorem ipsum), the timing is the model's"


def read_prompt(prompt: str | None, file: Path | None) -> str:
    """The prompt from the argument, ``-`` (stdin) or ``--file``: exactly one of them."""
    if (prompt is None) == (file is None):
        raise typer.BadParameter("give the prompt as an argument, `-` to read it from stdin, or --file PATH",
                                 param_hint="PROMPT / --file")
    if file is not None:
        try:
            text = file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise typer.BadParameter(f"cannot read {file}: {exc}", param_hint="--file") from exc
    elif prompt == "-":
        text = sys.stdin.read()
    else:
        text = str(prompt)
    if not text.strip():
        raise typer.BadParameter("the prompt is empty", param_hint="PROMPT")
    return text


def submit_cmd(
    prompt: str | None = typer.Argument(None, show_default=False,
                                        help="The prompt text; `-` reads it from stdin (or use --file)"),
    file: Path | None = typer.Option(None, "--file", "-f", dir_okay=False, help="Read the prompt from this file"),
    ttft_ms: float = typer.Option(500.0, "--ttft-ms", callback=positive, help="TTFT target in milliseconds (> 0)"),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Maximum output tokens (≥ 1; the engine "
                                                                    "refuses more than its context leaves)"),
    lam: float | None = typer.Option(None, "--lambda", min=0.0, help="λ ≥ 0 of U = acc − λ·cost (router default if unset)"),
    query_id: str | None = typer.Option(None, "--query-id", help="Idempotency key (default: random)"),
    model: str | None = typer.Option(None, "--model", help="Only this model's instances (served name, e.g. "
                                                           "Qwen/Qwen3-8B, or predictor name); default: BEAR chooses"),
    nats_url: NatsUrl = FIND_NATS,
    nats_creds: ClientNatsCreds = "",
    prefix: Prefix = "bear",
    as_json: bool = typer.Option(False, "--json", help="Print every message as a JSON line"),
) -> None:
    """Submit one query and stream the answer to the terminal (stdout: the answer; stderr: where it
    was routed, its TTFT against the target, and errors). Exit codes: docs/cli.md."""
    from rich.console import Console
    from rich.markup import escape

    text = read_prompt(prompt, file)
    err = Console(stderr=True, highlight=False)

    async def go() -> int:
        from bear.client.submit import submit
        from bear.protocol.replies import Chunk, Done, Error, Routed
        from bear.protocol.subjects import Subjects
        from bear.runtime.service import connect

        nc = await connect(nats_url, "bear-submit", connect_within_s=2.0, max_reconnect_attempts=3)
        code = 0
        streamed = False
        try:
            # aclosing: leaving early (Ctrl-C, an error) closes the stream, which tells the router
            async with contextlib.aclosing(submit(nc, text, ttft_target_s=ttft_ms / 1e3, max_tokens=max_tokens,
                                                  lam=lam, query_id=query_id, subjects=Subjects(prefix),
                                                  model=model)) as stream:
                async for m in stream:
                    if m.terminal and streamed:
                        print(flush=True)  # end the answer's line
                        streamed = False
                    if as_json:
                        print(json.dumps(json_safe(m.as_dict())), flush=True)
                    elif isinstance(m, Routed):
                        pt = m.predicted_ttft_s
                        sim = f"; {SIMULATED_NOTE}" if m.backend == "sim" else ""
                        err.print(escape(f"→ {m.instance} ({m.model}), predicted TTFT "
                                         f"{'-' if pt is None else f'{pt * 1e3:.0f} ms'} [{m.ttft_method}]"
                                         f"{sim}"), style="dim", soft_wrap=True)
                    elif isinstance(m, Chunk):
                        sys.stdout.write(m.text or "")
                        sys.stdout.flush()
                        streamed = True
                    elif isinstance(m, Done):
                        met = "met" if m.on_time else "missed"
                        ttft = "-" if m.ttft_s is None else f"{m.ttft_s * 1e3:.0f} ms"
                        err.print(escape(f"TTFT {ttft} (target {ttft_ms:.0f} ms: {met}), "
                                         f"utility {m.utility or 0:.4f}, usage {m.usage}"), style="dim", soft_wrap=True)
                    if isinstance(m, Error):
                        if not as_json:
                            print(f"error: {m.code}: {' '.join(m.message.split())}",
                                  file=sys.stderr, flush=True)
                        code = 3 if m.code == "unavailable" and m.client is True else 1
        finally:
            await nc.close()
        return code

    try:
        rc = aio.run(go())
    except KeyboardInterrupt:
        rc = 130  # bear.cli prints the one line
    raise typer.Exit(rc)


def register(app: typer.Typer) -> None:
    app.command("submit")(submit_cmd)
