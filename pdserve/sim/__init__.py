"""The simulator: pdserve's real engine core and router core on a simulated clock, over a
cost-model runner (runner.py), the serving front's CPU as one FIFO queue (api_process.py) and a
discrete-event loop (simulator.py); `pdserve simulate` (cli.py). Plain Python: no torch, no
zmq."""
from .runner import CostModelRunner, SimClock
from .simulator import (Deployment, SimConversation, SimRequest, SimResult, Simulator,
                        parse_deployment)

__all__ = ["CostModelRunner", "Deployment", "SimClock", "SimConversation", "SimRequest",
           "SimResult", "Simulator", "parse_deployment"]
