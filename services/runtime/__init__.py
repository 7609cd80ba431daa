"""How every BEAR process runs: the event loop, logging, NATS connection and key-value helpers,
signals and orderly shutdown, and a local nats-server for `bear up` and the tests."""
