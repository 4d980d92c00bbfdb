"""Request: one sequence the scheduler runs. A user request with n > 1 becomes n Requests; the
first computes the prompt, the others fork from it when its prefill completes.

Under async scheduling a sequence can be scheduled before the host knows its last token:

    positions   0 ........ num_tokens-1 | num_tokens ... num_tokens+num_pending-1
                prompt + known outputs  | sampled by a step in flight (on the device)

num_computed_tokens counts positions handed to a forward (advanced when scheduled, so the next
schedule() sees what a step in flight computes); a chunk that reaches into the pending positions
feeds the token the previous step sampled there (ScheduledChunk.last_pending)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sampling_params import SamplingParams


def sequence_id(request_id: str, index: int) -> str:
    """The id of sample `index` of user request `request_id` (what the scheduler, the runner
    and the KV transfer know it by). Made here only; never parsed back (the engine core's
    output table maps a sequence to its request)."""
    return f"{request_id}#{index}"


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # in the waiting queue (new or preempted)
    RUNNING = "running"
    SWAPPED = "swapped"          # preempted by swap: in the waiting queue, its KV on the host
    FORK_PENDING = "fork_pending"  # n > 1 sibling waiting for the first sequence's prefill
    WAITING_FOR_KV = "waiting_for_kv"  # P/D consumer: prompt KV on a producer, no blocks here yet
    LOADING_KV = "loading_kv"          # P/D consumer: blocks allocated, KV being pulled into them
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: "SamplingParams"
    seed: int | None = None                 # this sequence's sampling seed (None: engine's RNG)
    max_model_len: int = 1 << 30            # prompt + output never exceeds this
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0            # tokens whose K/V are in the cache or being written
    num_pending: int = 0                    # sampled by steps in flight, not in output_token_ids
    status: RequestStatus = RequestStatus.WAITING
    siblings: list["Request"] = field(default_factory=list)  # FORK_PENDING sequences forked from this one
    num_preemptions: int = 0
    hold_kv: bool = False                   # P/D producer: keep the blocks when finished
    num_cached_tokens: int | None = None    # prompt positions found in the prefix cache when
                                            # first admitted (None: not admitted yet)
    num_load_waits: int = 0                 # steps it waited for room to load its prefix back

    num_tokens: int = 0                     # prompt + output; kept by append_output (hot path)

    def __post_init__(self):
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_total_tokens(self) -> int:
        """Known and pending tokens: where the sequence stands once the steps in flight end."""
        return self.num_tokens + self.num_pending

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end); a pending position (at most the last, see the module docstring)
        holds 0 until the runner writes the sampled token there on the device."""
        if end > self.num_tokens:
            assert end == self.num_tokens + 1 <= self.num_total_tokens, "one pending token at most"
            return self._known_slice(start, end - 1) + [0]
        return self._known_slice(start, end)

    def _known_slice(self, start: int, end: int) -> list[int]:
        if start >= end:
            return []
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
