"""Prefill/decode disaggregation's data plane: the KV connectors that move a request's KV cache
between workers (connectors/). The router that picks each request's path is pdserve/routing;
the types both use are in pdserve/protocol.py."""
