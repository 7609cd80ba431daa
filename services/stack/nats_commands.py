"""``bear nats config`` and ``bear nats provision``: the authorization of a deployment's NATS
(what ``bear up`` does for its local server, for a server you run yourself — deploy/README.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from bear.options import NatsCreds, NatsUrl, Prefix

nats_app = typer.Typer(help="NATS authorization of a deployment: identities, server config, KV buckets.",
                       no_args_is_help=True)


@nats_app.command("config")
def config_cmd(
    out: Path = typer.Option(..., "--out", file_okay=False,
                             help="Folder for auth.conf (the server's accounts block) and one <identity>.json each"),
    instance: list[str] = typer.Option(
        [], "--instance", help="An instance id (repeatable): its identity may publish only its own snapshots, batch "
                               "records and registry key"),
    client: list[str] = typer.Option(
        ["client", "gateway"], "--client",
        help="A client application (repeatable; `gateway` gets the gateway's rights): each its own identity and "
             "private inbox prefix"),
    prefix: Prefix = "bear",
) -> None:
    """Generate fresh nkey identities for every service, client and instance, and the server
    authorization that gives each only its own subjects (docs/security.md)."""
    from bear.protocol.subjects import Subjects
    from bear.runtime.identity import NAME
    from bear.runtime.nats_auth import generate

    for name in [*instance, *client]:
        if not NAME.match(name):
            raise typer.BadParameter(f"{name!r}: ids are 1-128 letters, digits, '-' or '_' (one subject token)")
    if out.exists() and any(out.iterdir()):
        raise typer.BadParameter(f"{out} is not empty: identities are never overwritten", param_hint="--out")
    files = generate(out, list(instance), Subjects(prefix), clients=tuple(dict.fromkeys(client)))
    print(f"wrote {files.config} (include it in nats-server.conf) and {len(files.creds)} identities in {out}/ "
          "(mode 0600: hand each process only its own)")


@nats_app.command("provision")
def provision_cmd(
    nats_url: NatsUrl = "",
    nats_creds: NatsCreds = "",
    replicas: int = typer.Option(1, "--replicas", min=1, max=5, help="JetStream replicas of each KV bucket "
                                                                      "(3 on a 3-node cluster)"),
    prefix: Prefix = "bear",
) -> None:
    """Create the KV buckets (registry, calibration, dedup) as the admin identity: the services'
    identities may use them but not create, change or delete them."""
    from bear.protocol.subjects import Subjects
    from bear.runtime import aio
    from bear.runtime.kv import provision
    from bear.runtime.service import connect

    async def go() -> list[str]:
        nc = await connect(nats_url, "bear-nats-provision")
        try:
            return await provision(nc.jetstream(timeout=10.0), Subjects(prefix), replicas=replicas)
        finally:
            await nc.close()

    print("buckets: " + ", ".join(aio.run(go())))


def register(app: typer.Typer) -> None:
    app.add_typer(nats_app, name="nats")
