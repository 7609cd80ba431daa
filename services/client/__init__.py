"""The client side of ``bear.submit``: submit a query over NATS and read the router's stream."""
