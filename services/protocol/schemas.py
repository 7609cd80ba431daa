"""Every schema id of the wire contract (docs/contract.md), defined once: the ``v`` (or, for
snapshots, ``schema``) value each message carries. Every other module imports the constant
(tests/protocol/test_schemas.py fails on a schema id literal anywhere else in services/).

The C++ parsers in libbea (snapshot.cpp, snapshot_delta.cpp) hold their own copies of the
snapshot and delta ids; tests/protocol/test_schemas.py checks that they agree."""

from __future__ import annotations

# Instance state (bear.snapshot.<id>, bear.delta.<id>, bear.batches.<id>, bear.resync.<id>)
SNAPSHOT = "bear.snapshot/1"
DELTA = "bear.delta/1"
BATCH = "bear.batch/1"
RESYNC = "bear.resync/1"
INSTANCE = "bear.instance/1"  # registry entry (bear_instances bucket)
PROVISIONED = "bear.provisioned/1"  # bear_provisioned bucket
CALIBRATION = "bear.calibration/1"  # bear_calibration bucket

# Prefix-cache events (bear.kv.<id>, bear.kv.resync.<id>)
KV = "bear.kv/1"
KV_STATE = "bear.kv.state/1"
KV_RESYNC = "bear.kv.resync/1"

# Client ↔ router (bear.submit[.<client>], bear.cancel, the client's inbox)
SUBMIT = "bear.submit/1"
CANCEL = "bear.cancel/1"
RESEND = "bear.resend/1"  # on bear.cancel: chunks of an answer that did not arrive, sent again
ROUTED = "bear.routed/1"
CHUNK = "bear.chunk/1"
DONE = "bear.done/1"
ERROR = "bear.error/1"  # also every service's error reply (bear.protocol.errors)

# Router ↔ services (bear.dispatch.<id>, bear.outcome.<id>, bear.predict, bear.estimate)
DISPATCH = "bear.dispatch/1"
OUTCOME = "bear.outcome/1"
PREDICT = "bear.predict/1"
PREDICTION = "bear.prediction/1"
ESTIMATE = "bear.estimate/1"
ESTIMATE_REPLY = "bear.estimate.reply/1"

# Files and stored objects (not bus messages, but versioned the same way)
IDENTITY = "bear.identity/1"  # identity files (bear.runtime.identity)
PREDICTOR = "bear.predictor/1"  # a trained predictor's model file
TOKENIZER = "bear.tokenizer/1"  # tokenizer bundles (bear_tokenizers object store)
STACK = "bear.stack/1"  # the stack's discovery/state file (bear.stack.discovery)

ALL: tuple[str, ...] = (
    SNAPSHOT, DELTA, BATCH, RESYNC, INSTANCE, PROVISIONED, CALIBRATION, KV, KV_STATE, KV_RESYNC,
    SUBMIT, CANCEL, RESEND, ROUTED, CHUNK, DONE, ERROR, DISPATCH, OUTCOME, PREDICT, PREDICTION, ESTIMATE,
    ESTIMATE_REPLY, IDENTITY, PREDICTOR, TOKENIZER, STACK,
)
REPLY_STREAM: tuple[str, ...] = (ROUTED, CHUNK, DONE, ERROR)
TERMINAL: tuple[str, ...] = (DONE, ERROR)
