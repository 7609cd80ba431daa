"""The OpenAI-compatible HTTP gateway (``bear gateway``): OpenAI requests in, ``bear.submit`` over
NATS to the routers, the router's stream back as OpenAI responses. Reference: docs/gateway.md."""
