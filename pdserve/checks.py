"""Value checks shared by the frozen configs (EngineConfig, WorkerConfig, RestartPolicy,
ServeOptions, SamplingParams): a bool is never a number here, and an error names the field."""
from __future__ import annotations


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(name: str, v, minimum: int = 1, allow_none: bool = False) -> None:
    """ValueError unless v is an integer >= minimum (1: positive, 0: non-negative)."""
    if v is None and allow_none:
        return
    if not is_int(v) or v < minimum:
        kind = {1: "a positive integer", 0: "a non-negative integer"}.get(
            minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {kind}, got {v!r}")


def check_number(name: str, v, allow_zero: bool = False) -> None:
    """ValueError unless v is a number > 0 (>= 0 with allow_zero; NaN never passes)."""
    if not is_number(v) or not (v >= 0 if allow_zero else v > 0):
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {kind} number, got {v!r}")
