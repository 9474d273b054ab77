"""``BlockTables``: each running request's block table as an int32 array kept from step to step.

Every step's batch carries the block table of each of its rows. A request at 1M tokens of context owns 65,536
blocks of 16 tokens, and converting that list to an array every step cost milliseconds of host time, more than the
device time of the decode step. Here a request's array persists between steps and takes only the blocks its list
gained since: a request's list only grows by appends until ``Request.set_blocks`` replaces it, which changes
``blocks_epoch`` and rebuilds the array. Buffers are never written below what was handed out, so every array
handed out stays as it was. The runner drops a request's array when the plan says it finished or was preempted.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from flashinfra.engine.sched.plan import ScheduledRequest


class BlockTables:
    def __init__(self) -> None:
        self._rows: dict[str, tuple[int, np.ndarray, int]] = {}  # request -> (epoch, buffer, blocks filled)

    def table(self, sr: ScheduledRequest) -> np.ndarray:
        """``sr.block_table`` as an int32 array (a view of the request's buffer)."""
        ids, n = sr.block_table, len(sr.block_table)
        row = self._rows.get(sr.request_id)
        if row is None or row[0] != sr.blocks_epoch or row[2] > n:
            buf, have = np.empty(max(16, n), dtype=np.int32), 0
        else:
            _, buf, have = row
        if n > have:
            if n > len(buf):
                grown = np.empty(2 * n, dtype=np.int32)
                grown[:have] = buf[:have]
                buf = grown
            buf[have:n] = ids[have:n]
        self._rows[sr.request_id] = (sr.blocks_epoch, buf, n)
        return buf[:n]

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._rows.pop(rid, None)

    def __len__(self) -> int:
        return len(self._rows)
