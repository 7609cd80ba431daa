"""NATS subject names (design.md §2), built from one configurable prefix."""

from __future__ import annotations

from dataclasses import dataclass

from bear.protocol import schemas

SNAPSHOT_SCHEMA = schemas.SNAPSHOT
DELTA_SCHEMA = schemas.DELTA
BATCH_SCHEMA = schemas.BATCH
CANCEL_SCHEMA = schemas.CANCEL

# The queue groups of the request subjects (one name, whatever the prefix): a predictor or an
# estimator identity may subscribe to its request subject only as a member of its group
# (bear.runtime.nats_auth), so a leaked one gets its share of the requests and never a copy of all.
# The shards' workers share one group name too: a message on ``bear.estimate.<k>`` matches only
# shard k's subscriptions (and a wildcard one's, which the group then splits with them).
PREDICTOR_QUEUE = "bear-predictor"
ESTIMATOR_QUEUE = "bear-estimator"


def inbox_owner(inbox: str) -> str:
    """The identity whose private inbox prefix ``inbox`` lies under (``_INBOX_<name>.…`` →
    ``<name>``; "" for the anonymous ``_INBOX.…``)."""
    if not inbox.startswith("_INBOX_"):
        return ""
    return inbox[len("_INBOX_"):].split(".", 1)[0]


@dataclass(frozen=True)
class Subjects:
    """All subjects and bucket names for one deployment prefix (default ``bear``)."""

    prefix: str = "bear"

    def snapshot(self, instance: str) -> str:
        return f"{self.prefix}.snapshot.{instance}"

    def delta(self, instance: str) -> str:
        """``bear.delta.<id>``: the instance's per-step ``bear.delta/1`` messages."""
        return f"{self.prefix}.delta.{instance}"

    def resync(self, instance: str) -> str:
        """``bear.resync.<id>``: request-reply, answered by the instance's publisher with its newest
        full ``bear.snapshot/1`` (a consumer whose delta chain broke)."""
        return f"{self.prefix}.resync.{instance}"

    def batches(self, instance: str) -> str:
        return f"{self.prefix}.batches.{instance}"

    def dispatch(self, instance: str) -> str:
        return f"{self.prefix}.dispatch.{instance}"

    @property
    def snapshot_all(self) -> str:
        return f"{self.prefix}.snapshot.*"

    @property
    def delta_all(self) -> str:
        return f"{self.prefix}.delta.*"

    @property
    def batches_all(self) -> str:
        return f"{self.prefix}.batches.*"

    @property
    def dispatch_all(self) -> str:
        return f"{self.prefix}.dispatch.*"

    def kv(self, instance: str) -> str:
        """``bear.kv.<instance>``: the instance's prefix-cache events (``bear.kv/1``) and, after a
        resync request, its whole state (``bear.kv.state/1``), in one ordered stream."""
        return f"{self.prefix}.kv.{instance}"

    @property
    def kv_all(self) -> str:
        return f"{self.prefix}.kv.*"

    def kv_resync(self, instance: str) -> str:
        """``bear.kv.resync.<instance>``: a mirror asks the publisher for the whole state."""
        return f"{self.prefix}.kv.resync.{instance}"

    def outcome(self, instance: str) -> str:
        return f"{self.prefix}.outcome.{instance}"

    @property
    def outcome_all(self) -> str:
        return f"{self.prefix}.outcome.*"

    @property
    def predict(self) -> str:
        return f"{self.prefix}.predict"

    @property
    def estimate(self) -> str:
        return f"{self.prefix}.estimate"

    def estimate_shard(self, shard: int, shards: int) -> str:
        """The estimate subject of one shard (``bear.estimate`` when the pool is not sharded)."""
        return self.estimate if shards <= 1 else f"{self.prefix}.estimate.{shard}"

    @property
    def submit(self) -> str:
        """``bear.submit``: submissions of anonymous clients (``--insecure``), answered only into
        the anonymous inbox prefix ``_INBOX.`` (``reply_owner``)."""
        return f"{self.prefix}.submit"

    def submit_as(self, client: str) -> str:
        """``bear.submit.<client>``: the submissions of client identity ``client`` — only it may
        publish here (bear.runtime.nats_auth), and routers answer only into ``_INBOX_<client>.``."""
        return f"{self.prefix}.submit.{client}"

    @property
    def submit_all(self) -> str:
        return f"{self.prefix}.submit.*"

    def submit_for_inbox(self, inbox: str) -> str:
        """Where a client whose reply inbox is ``inbox`` submits: ``bear.submit.<name>`` for an
        identity's inbox (``_INBOX_<name>.…``), else ``bear.submit``."""
        name = inbox_owner(inbox)
        return self.submit_as(name) if name else self.submit

    def reply_owner(self, subject: str, reply: str) -> str | None:
        """The client a submission on ``subject`` with reply subject ``reply`` is answered for
        ("" anonymous), or None when the reply does not lie in the submitter's own inbox — a
        router answers nowhere else (not into a service's subject, a bucket or another client's
        inbox: issue 26). The subject's client token is the server's word (only that identity may
        publish it); the reply must lie below that identity's inbox prefix."""
        if subject == self.submit:
            return "" if reply.startswith("_INBOX.") and len(reply) > 7 else None
        head = f"{self.prefix}.submit."
        if not subject.startswith(head):
            return None
        client = subject[len(head):]
        if not client or "." in client or not reply.startswith(f"_INBOX_{client}.") \
                or len(reply) <= len(client) + 8 or "*" in reply or ">" in reply:
            return None
        return client

    def router_alive(self, router: str) -> str:
        """``bear.router.alive.<digest of the router's name>``: request-reply, answered by that
        router while its connection lives; "no responders" says it is gone (bear.router.takeover)."""
        import hashlib

        return f"{self.prefix}.router.alive.{hashlib.sha1(router.encode()).hexdigest()[:16]}"

    @property
    def router_alive_all(self) -> str:
        return f"{self.prefix}.router.alive.*"

    @property
    def cancel(self) -> str:
        """``bear.cancel``: a client gave up on a query (``bear.cancel/1 {query_id}``); every router
        subscribes (no queue group) and the one serving it aborts the generation."""
        return f"{self.prefix}.cancel"

    @property
    def instances_bucket(self) -> str:
        return f"{self.prefix}_instances"

    @property
    def calibration_bucket(self) -> str:
        return f"{self.prefix}_calibration"

    @property
    def tokenizers_bucket(self) -> str:
        """Object store of tokenizer bundles, one object per tokenizer id (``bear.tokenizer``)."""
        return f"{self.prefix}_tokenizers"

    @property
    def provisioned_bucket(self) -> str:
        """KV bucket of what each instance was provisioned with (model, base URL, prices): only
        ``admin`` writes it; routers take only registry entries that match (issue 26)."""
        return f"{self.prefix}_provisioned"

    @property
    def queries_bucket(self) -> str:
        """Create-only KV bucket of the query ids routers have claimed (deduplication)."""
        return f"{self.prefix}_queries"

    @property
    def terminals_bucket(self) -> str:
        """KV bucket of the routers' recent terminal messages (done/error, kept a minute), each
        under ``terminal_key`` of its answer's inbox: a client whose stream went silent — a NATS
        restart lost the router's last message — reads its own there (issue 26)."""
        return f"{self.prefix}_terminals"

    @staticmethod
    def terminal_key(inbox: str) -> str:
        """The terminal record's key of the answer to ``inbox``: a hash, so the key is a valid KV
        key and as unguessable as the (private, random) inbox itself."""
        import hashlib

        return hashlib.sha256(inbox.encode()).hexdigest()[:40]

    @staticmethod
    def shard_of(instance: str, shards: int) -> int:
        """The estimator shard that owns ``instance``: FNV-1a (32 bit) of its id modulo the number
        of shards — stable across processes and versions, so routers and workers agree."""
        if shards <= 1:
            return 0
        h = 0x811C9DC5
        for byte in instance.encode():
            h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
        return h % shards

    @staticmethod
    def instance_of(subject: str) -> str:
        """The last token of a per-instance subject (``bear.snapshot.<id>`` → ``<id>``)."""
        return subject.rsplit(".", 1)[-1]
