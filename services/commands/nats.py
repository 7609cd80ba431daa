"""``bear nats config`` and ``bear nats provision``: the authorization of a deployment's NATS
(what ``bear up`` does for its local server, for a server you run yourself — deploy/README.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from bear.commands.options import NatsCreds, NatsUrl, Prefix

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
    service_replicas: list[str] = typer.Option(
        [], "--service-replicas", metavar="SERVICE=N",
        help="One identity per replica (repeatable; predictor or estimator): `estimator=3` writes estimator-0 … "
             "estimator-2 instead of one shared `estimator`, so a leaked replica is revoked alone (give "
             "`bear estimator --workers 3` --nats-creds 'DIR/estimator-{worker}.json')"),
    prefix: Prefix = "bear",
) -> None:
    """Generate fresh nkey identities for every service, client and instance, and the server
    authorization that gives each only its own subjects (docs/security.md)."""
    from bear.protocol.subjects import Subjects
    from bear.runtime.identity import NAME
    from bear.runtime.nats_auth import REPLICATED, generate, is_service_name

    for name in [*instance, *client]:
        if not NAME.match(name):
            raise typer.BadParameter(f"{name!r}: ids are 1-128 letters, digits, '-' or '_' (one subject token)")
    for name in client:
        if is_service_name(name):
            raise typer.BadParameter(f"{name!r} is a service's or an instance's identity", param_hint="--client")
    replicas: dict[str, int] = {}
    for item in service_replicas:
        svc, _, n = item.partition("=")
        if svc not in REPLICATED or not n.isdigit() or not 1 <= int(n) <= 64:
            raise typer.BadParameter(f"{item!r}: SERVICE=N with SERVICE one of {', '.join(REPLICATED)} and N in 1..64",
                                     param_hint="--service-replicas")
        replicas[svc] = int(n)
    if out.exists() and any(out.iterdir()):
        raise typer.BadParameter(f"{out} is not empty: identities are never overwritten", param_hint="--out")
    files = generate(out, list(instance), Subjects(prefix), clients=tuple(dict.fromkeys(client)), replicas=replicas)
    print(f"wrote {files.config} (include it in nats-server.conf) and {len(files.creds)} identities in {out}/ "
          "(mode 0600: hand each process only its own)")
    from bear.runtime.nats_auth import SHARED_CLIENT, shared_client_note

    if SHARED_CLIENT in client:
        print(f"note: {shared_client_note(out)}")


@nats_app.command("provision")
def provision_cmd(
    nats_url: NatsUrl = "",
    nats_creds: NatsCreds = "",
    replicas: int = typer.Option(1, "--replicas", min=1, max=5, help="JetStream replicas of each KV bucket "
                                                                      "(3 on a 3-node cluster)"),
    instances: Path | None = typer.Option(
        None, "--instances", dir_okay=False,
        help="JSON file {instance id: {model, base_url, price_input_per_mtok, price_output_per_mtok, "
             "[predictor_model], [max_model_len]}}: bind each instance to what it was provisioned with (routers with "
             "--provisioning take only registry entries that agree)"),
    prefix: Prefix = "bear",
) -> None:
    """Create the KV buckets (registry, calibration, dedup, provisioning) as the admin identity: the
    services' identities may use them but not create, change or delete them; with --instances, bind
    each instance to its model, base URL and prices (docs/security.md)."""
    from bear.protocol.subjects import Subjects
    from bear.runtime import aio
    from bear.runtime.kv import bind_instances, provision
    from bear.runtime.service import connect

    bindings = _bindings(instances) if instances is not None else []

    async def go() -> tuple[list[str], list[str]]:
        nc = await connect(nats_url, "bear-nats-provision")
        try:
            buckets = await provision(nc.jetstream(timeout=10.0), Subjects(prefix), replicas=replicas)
            return buckets, await bind_instances(nc.jetstream(timeout=10.0), Subjects(prefix), bindings)
        finally:
            await nc.close()

    buckets, bound = aio.run(go())
    print("buckets: " + ", ".join(buckets) + (f"; bound {len(bound)} instances: {', '.join(bound)}" if bound else ""))


def _bindings(path: Path) -> list[Any]:
    """The instances' bindings in ``path`` (``--instances``); a one-line error naming what is wrong."""
    import json

    import msgspec

    from bear.protocol.provisioned import Provisioned, provisioned

    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="--instances") from exc
    if not isinstance(d, dict) or not all(isinstance(v, dict) for v in d.values()):
        raise typer.BadParameter(f"{path} must map instance ids to {{model, base_url, prices}}", param_hint="--instances")
    out: list[Provisioned] = []
    for inst, f in d.items():
        try:
            b = provisioned(inst, f["model"], f["base_url"], f.get("price_input_per_mtok", 0.0),
                            f.get("price_output_per_mtok", 0.0), predictor_model=f.get("predictor_model", ""),
                            max_model_len=f.get("max_model_len"))
            out.append(msgspec.convert(msgspec.to_builtins(b), Provisioned))  # validated: id, types, prices ≥ 0
        except (KeyError, TypeError, AttributeError, msgspec.ValidationError) as exc:
            raise typer.BadParameter(f"{path}: instance {inst!r}: {exc!r}", param_hint="--instances") from exc
    return out


def register(app: typer.Typer) -> None:
    app.add_typer(nats_app, name="nats")
