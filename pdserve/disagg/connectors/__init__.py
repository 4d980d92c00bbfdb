"""KV connectors: how a consumer (decode) rank gets a request's KV blocks from a producer
(prefill) worker. One interface and registry (base.py), the load bookkeeping every transport
shares (load_tracker.py), the head re-sharding plan (head_plan.py), and one module per transport
family: the one-sided same-host pull with its peer / relay / file paths (shared_pull.py, the
relay's copy engine in host_relay.py) and the two-sided pairs (pair.py; torch_dist.py, nccl.py).
Transports are imported when their name is first asked for."""
from .base import (KVConnector, check_connector_name, connector_names, get_connector_class,
                   register_connector)

__all__ = ["KVConnector", "check_connector_name", "connector_names", "get_connector_class",
           "register_connector"]
