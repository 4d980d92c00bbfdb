"""Service-level objectives on a request's latencies, and whether a request meets them (what
goodput counts). Plain Python: the benchmarks, a router and a simulator share it.

SLOs are in milliseconds, keyed by metric: ttft (time to first token), tpot (time per output
token after the first), e2el (send to last token)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .metrics import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(SLO_KEYS)}; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if not ms >= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
        slos[key] = ms
    return slos


def meets_slos(r: "RequestResult", slos: dict[str, float]) -> bool:
    """A completed request meets every given SLO (ms); a one-token request has no TPOT and
    meets any TPOT SLO."""
    if not r.success:
        return False
    if "ttft" in slos and r.ttft * 1e3 > slos["ttft"]:
        return False
    if "tpot" in slos and r.tpot is not None and r.tpot * 1e3 > slos["tpot"]:
        return False
    return not ("e2el" in slos and r.latency * 1e3 > slos["e2el"])
