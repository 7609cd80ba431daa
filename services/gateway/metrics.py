"""The gateway's Prometheus metrics (served at its own ``/metrics``)."""

from __future__ import annotations

from functools import cache
from typing import Any

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OVERHEAD_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)


@cache
def metrics() -> Any:
    """One set per process (prometheus_client's default registry)."""
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    return SimpleNamespace(
        requests=Counter("bear_gateway_requests_total", "HTTP requests by endpoint and status code",
                         ["endpoint", "status"]),
        ttfb=Histogram("bear_gateway_ttfb_seconds",
                       "Request received → first byte of the response body written (streaming: the first "
                       "token; otherwise the whole answer)", ["endpoint"], buckets=LATENCY_BUCKETS),
        overhead=Histogram("bear_gateway_overhead_seconds",
                           "The gateway's own time before the first byte: request received → submitted, plus "
                           "the router's message → its bytes written", buckets=OVERHEAD_BUCKETS),
        inflight=Gauge("bear_gateway_inflight", "Completion requests in progress"),
        connections=Gauge("bear_gateway_connections", "HTTP connections open"),
        conn_refused=Counter("bear_gateway_connections_refused_total",
                             "Connections answered and closed at once: reason peer_cap (too many open from one "
                             "address, 429) or total_cap (the gateway's most, 503)", ["reason"]),
        header_timeouts=Counter("bear_gateway_header_timeouts_total",
                                "Connections closed (408) because a request's headers did not arrive within the "
                                "header timeout"),
        cancelled=Counter("bear_gateway_client_disconnects_total",
                          "Requests whose client went away before the answer ended (the generation is cancelled)"),
    )
