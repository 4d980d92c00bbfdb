"""Helpers the benchmarks share: where the numbers came from (hardware, git) and how they are
written, plus the seeded random-token workload."""
from __future__ import annotations

import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Iterable

import numpy as np
import torch

from ..perf.files import write_json

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _mem_total_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def hardware_info() -> dict[str, Any]:
    """CPU model, cores, memory, torch version and threads, GPU name when there is one, and the
    load average at the time of the call (other processes skew CPU numbers)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "memory_gb": _mem_total_gb(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        info["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda_version"] = torch.version.cuda
    return info


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_info() -> dict[str, Any]:
    """{"git_commit": HEAD's sha or "uncommitted", "git_dirty": bool}. Dirty means a tracked file
    differs from HEAD or an untracked file sits inside the pdserve package (code that ran but is
    not in the commit); untracked files elsewhere (results, scratch) do not count. Read-only git
    calls, run in the folder that holds the pdserve package."""
    if os.environ.get("PDSERVE_GIT_COMMIT"):  # runs on a copied tree without .git (the device)
        return {"git_commit": os.environ["PDSERVE_GIT_COMMIT"],
                "git_dirty": os.environ.get("PDSERVE_GIT_DIRTY", "0") == "1"}
    commit = _git("rev-parse", "--verify", "-q", "HEAD")
    if not commit:
        return {"git_commit": "uncommitted", "git_dirty": True}
    tracked = _git("status", "--porcelain", "--untracked-files=no")
    untracked = _git("status", "--porcelain", "--untracked-files=all", "--", "pdserve")
    if tracked is None or untracked is None:
        return {"git_commit": commit, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": bool(tracked) or bool(untracked)}


def write_result(path: str | os.PathLike, payload: dict[str, Any]) -> str:
    """Write payload as indented JSON (parent folders created, replaced atomically); returns the
    path written."""
    return write_json(path, payload)


def random_prompts(num: int, min_len: int, max_len: int, vocab_size: int, seed: int,
                   exclude_ids: Iterable[int] = ()) -> list[list[int]]:
    """`num` prompts of random token ids, lengths uniform in [min_len, max_len) (exactly min_len
    when max_len <= min_len), ids uniform over the vocabulary less exclude_ids. Deterministic in
    the seed."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if min_len < 1:
        raise ValueError(f"min_len must be >= 1, got {min_len}")
    excluded = {int(i) for i in exclude_ids if 0 <= int(i) < vocab_size}
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64),
                           np.fromiter(excluded, dtype=np.int64, count=len(excluded)))
    if allowed.size == 0:
        raise ValueError("no token ids left after excluding the special ones")
    rng = np.random.default_rng(seed)
    if max_len <= min_len:
        lens = np.full(num, min_len, dtype=np.int64)
    else:
        lens = rng.integers(min_len, max_len, size=num)
    return [allowed[rng.integers(0, allowed.size, size=int(n))].tolist() for n in lens]


def _proc_stat_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU jiffies of the whole machine, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(fields[:8])             # user nice system idle iowait irq softirq steal
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return total - idle, total


class CpuUsage:
    """Context manager: how much CPU this process and everything else used while it was open, to
    tell a clean CPU measurement from one that shared the machine with other work.

    After exit, .result() is {"wall_s", "process_cpu_s", "machine_busy_cpu_s", "other_cpu_s",
    "other_load"}; other_load is the average number of cores that other processes kept busy
    (0 on an otherwise idle machine; ~1 means one core was taken away)."""

    def __enter__(self) -> "CpuUsage":
        self._t = time.perf_counter()
        self._p = time.process_time()
        self._s = _proc_stat_jiffies()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t
        self.process_cpu_s = time.process_time() - self._p
        end = _proc_stat_jiffies()
        self.machine_busy_cpu_s = None
        if self._s is not None and end is not None:
            self.machine_busy_cpu_s = (end[0] - self._s[0]) / os.sysconf("SC_CLK_TCK")

    def result(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {"wall_s": round(self.wall_s, 3),
                                        "process_cpu_s": round(self.process_cpu_s, 3),
                                        "machine_busy_cpu_s": None, "other_cpu_s": None,
                                        "other_load": None}
        if self.machine_busy_cpu_s is not None:
            other = max(0.0, self.machine_busy_cpu_s - self.process_cpu_s)
            out.update(machine_busy_cpu_s=round(self.machine_busy_cpu_s, 3),
                       other_cpu_s=round(other, 3),
                       other_load=round(other / self.wall_s, 3) if self.wall_s > 0 else None)
        return out


def copy_bandwidth(device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes moved (read + written) per second by a large device-to-device copy (the roofline's
    bandwidth), median of `reps` copies after warm-up."""
    device = torch.device(device)
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release_llm(llm) -> None:
    """Free an LLM's CUDA graphs before the caller drops its last reference to it (then
    free_device_memory: its KV pool, host tier and weights go with that reference)."""
    runner = getattr(llm.llm_engine, "runner", None)
    if runner is not None:
        runner.release()


def free_device_memory(device: torch.device) -> None:
    """Collect what an engine dropped just now left, and give CUDA's cached blocks back (so the
    next engine built in this process sizes its pool from the whole budget)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_described(name: str, run, args, argv: list[str], output: str) -> dict[str, Any] | None:
    """Runs a benchmark's run(args) and wraps its result in the payload every result file has
    (command, git, hardware with the load average at the start too, config, timestamp); None
    after printing the error when run raises ValueError / OSError."""
    start = hardware_info()
    try:
        body = run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    hw = hardware_info()
    hw["load_avg_at_start"] = start.get("load_avg_1_5_15")
    return {"benchmark": name, "command": ["pdserve", "bench", name, *argv], **git_info(),
            "hardware": hw, "config": {**vars(args), "output": output},
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **body}
