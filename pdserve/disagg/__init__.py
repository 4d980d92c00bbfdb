"""Prefill/decode disaggregation: KV connectors (moving a request's KV cache between workers),
the router that chooses a path per request, and the types they share."""
