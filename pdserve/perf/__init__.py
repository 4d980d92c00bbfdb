"""Performance arithmetic shared by the benchmarks, the router and the simulator: workloads
(arrivals, request lengths, datasets), per-request results and run metrics, SLOs and goodput.
Plain Python and numpy: nothing here imports torch, zmq, an HTTP client or server."""
