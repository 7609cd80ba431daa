"""``bear submit``: one query through the router from the shell."""

from __future__ import annotations

import json
import sys

import typer

from bear.options import DEFAULT_NATS, NatsUrl, Prefix
from bear.protocol.codec import json_safe
from bear.runtime import aio


def submit_cmd(
    prompt: str = typer.Argument(..., help="The prompt text"),
    ttft_ms: float = typer.Option(500.0, "--ttft-ms", help="TTFT target in milliseconds"),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Maximum output tokens"),
    lam: float | None = typer.Option(None, "--lambda", help="λ of U = acc − λ·cost (router default if unset)"),
    query_id: str | None = typer.Option(None, "--query-id", help="Idempotency key (default: random)"),
    model: str | None = typer.Option(None, "--model", help="Only this model's instances (served name, e.g. "
                                                           "Qwen/Qwen3-8B, or predictor name); default: BEAR chooses"),
    nats_url: NatsUrl = DEFAULT_NATS,
    prefix: Prefix = "bear",
    as_json: bool = typer.Option(False, "--json", help="Print every message as a JSON line"),
) -> None:
    """Submit one query and stream the answer to the terminal."""
    from rich.console import Console

    err = Console(stderr=True)

    async def go() -> int:
        import nats

        from bear.client.submit import submit
        from bear.protocol.subjects import Subjects

        nc = await nats.connect(nats_url, max_reconnect_attempts=3)
        code = 0
        try:
            async for m in submit(nc, prompt, ttft_target_s=ttft_ms / 1e3, max_tokens=max_tokens, lam=lam,
                                  query_id=query_id, subjects=Subjects(prefix), model=model):
                v = m.get("v")
                if as_json:
                    print(json.dumps(json_safe(m)), flush=True)
                elif v == "bear.routed/1":
                    pt = m.get("predicted_ttft_s")
                    err.print(f"[dim]→ {m['instance']} ({m['model']}), predicted TTFT "
                              f"{'-' if pt is None else f'{pt * 1e3:.0f} ms'} [{m.get('ttft_method')}][/dim]")
                elif v == "bear.chunk/1":
                    sys.stdout.write(m.get("text", ""))
                    sys.stdout.flush()
                elif v == "bear.done/1":
                    ok = "[green]met[/green]" if m.get("on_time") else "[red]missed[/red]"
                    err.print(f"\n[dim]TTFT {m['ttft_s'] * 1e3:.0f} ms (target {ttft_ms:.0f} ms: {ok}), utility "
                              f"{m.get('utility', 0):.4f}, usage {m.get('usage')}[/dim]")
                elif v == "bear.error/1":
                    e = m.get("error", {})
                    err.print(f"\n[red]error {e.get('code')}: {e.get('message')}[/red]")
                    code = 1
        finally:
            await nc.close()
        return code

    raise typer.Exit(aio.run(go()))



def register(app: typer.Typer) -> None:
    app.command("submit")(submit_cmd)
