"""What a TP driver (rank 0) sends the other ranks each step, and how they rebuild it.

Block tables dominate a step's size (batch x blocks per sequence) and change little from step to
step, so each rank keeps its own copy of every live table and the driver sends only the change:

    driver mirror[r] = [7, 3, 9]          live table = [7, 3, 9, 12]   -> ("+", [12])
    driver mirror[r] = [7, 3, 9]          live table = [4, 5]          -> ("=", [4, 5])  (rebuilt
                                                                          after a preemption)
    finished ids                                                        -> both drop their copy

At batch 256 with 64 blocks per sequence the whole tables pickle to 60 KB and take ~2 ms to
unpickle on a CI core; a decode step's delta is a few bytes per sequence. Everything else a
forward needs (tokens, positions, forks, block copies, new requests' sampling params, the KV
coordinator's work for the connectors, the host tier's KVMoves) is sent as is. A pending token (async scheduling) is not
known here either: every rank takes it from the sampled tokens the driver broadcasts. Pure
Python: tested on CPU without processes.
"""
from __future__ import annotations

import pickle

from ..engine.scheduler import ScheduledChunk, SchedulerOutput

_APPEND, _REPLACE = 0, 1


class StepEncoder:
    """Driver side: SchedulerOutput -> bytes, remembering the tables the followers hold."""

    def __init__(self):
        self.mirror: dict[str, list[int]] = {}

    def encode(self, sched: SchedulerOutput) -> bytes:
        for rid in sched.finished_ids:
            self.mirror.pop(rid, None)
        rows = []
        for c in sched.chunks:
            live, held = c.block_table, self.mirror.get(c.request_id)
            n = 0 if held is None else len(held)
            if held is not None and n <= len(live) and live[:n] == held:
                mode, blocks = _APPEND, live[n:]
                held.extend(blocks)
            else:
                mode, blocks = _REPLACE, list(live)
                self.mirror[c.request_id] = list(live)
            rows.append((c.request_id, c.token_ids, c.start_pos, c.sample, c.last_pending, mode,
                         blocks))
        return pickle.dumps((rows, sched.forks, sched.block_copies, sched.new_requests,
                             sched.finished_ids, sched.kv_work, sched.kv_moves), protocol=pickle.HIGHEST_PROTOCOL)


class StepDecoder:
    """Follower side: bytes -> the SchedulerOutput the driver encoded (tables from its copies)."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def decode(self, payload: bytes) -> SchedulerOutput:
        rows, forks, copies, new, finished, kv_work, kv_moves = pickle.loads(payload)
        for rid in finished:
            self.tables.pop(rid, None)
        chunks = []
        for rid, tokens, start, sample, pending, mode, blocks in rows:
            if mode == _APPEND:
                table = self.tables[rid]
                table.extend(blocks)
            else:
                table = self.tables[rid] = blocks
            chunks.append(ScheduledChunk(rid, tokens, start, table, sample, pending))
        return SchedulerOutput(chunks=chunks, forks=forks, block_copies=copies,
                               new_requests=new, finished_ids=finished, kv_work=kv_work,
                               kv_moves=kv_moves)
