"""Performance arithmetic shared by the benchmarks, the router and the simulator: workloads
(arrivals, request lengths, datasets), per-request results and run metrics, SLOs and goodput,
and the step-cost profile (cost_profile.py) with its fits (cost_fit.py). Plain Python and numpy:
nothing here imports torch, zmq, an HTTP client or server at import time (profiler.py, which
drives the engine for `pdserve profile`, imports them inside run())."""
