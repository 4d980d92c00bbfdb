"""What the engine core drives: an Executor runs one scheduled step (the in-process ModelRunner
satisfies it; a simulator's cost-model runner can too). Plain types only: the core never sees
a tensor."""
from __future__ import annotations

from typing import NamedTuple, Protocol

from ..protocol import KVLoadDone
from .scheduler import SchedulerOutput


class SampledToken(NamedTuple):
    token_id: int
    logprob: float | None                      # of the sampled token (when logprobs were asked)
    top: list[tuple[int, float]] | None        # top-k (id, logprob), most likely first


class StepHandle(Protocol):
    """A step an executor started (Executor.execute_async)."""

    def result(self) -> dict[str, SampledToken]:
        """Waits for the step's sampled tokens (what execute would return). Called once."""


class Ready:
    """A StepHandle whose tokens are known already (a step that ran to the end)."""

    def __init__(self, sampled: dict[str, SampledToken]):
        self._sampled = sampled

    def result(self) -> dict[str, SampledToken]:
        return self._sampled


class Executor(Protocol):
    def execute(self, sched: SchedulerOutput) -> dict[str, SampledToken]:
        """Run the step: the KV work, block copies, the forward over every chunk, sampling.
        Returns the new token of every sequence whose chunk has sample=True and of every
        fork (by sequence id); {} for a step without chunks."""

    def execute_async(self, sched: SchedulerOutput) -> StepHandle:
        """Optional (async scheduling; an executor without it runs every step with execute).
        Start the step and return without waiting for its tokens. Steps run in the order they
        are started and the engine core starts the next one before it reads this one's result,
        so a chunk with last_pending=True feeds the token that the step started just before
        sampled for that sequence (the executor keeps it where it was made: the device). The
        core reads results in the order the steps were started; the sequences of a step whose
        result was not read yet may already be in a later step's finished_ids."""

    def take_prompt_logprobs(self) -> dict[str, list[SampledToken]]:
        """Prompt-token logprobs computed since the last call, per sequence, in prompt order
        (entry j is prompt token j + 1 given tokens 0..j)."""

    def poll_loads(self) -> list[KVLoadDone]:
        """P/D consumer: the loads this executor saw end since the last call ([] without a
        connector)."""

    def take_gpu_times(self) -> dict[int, float | None]:
        """The device time (ms) of the forward of each step (by SchedulerOutput.step_id) whose
        measurement has settled since the last call: a number once its events completed (never
        waited for), None where nothing was measured (CPU, a step without a forward). Steps
        still running on the device are left for a later call."""
