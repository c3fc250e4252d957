"""Spawn CPU ranks for the demos and stream the rows rank 0 reports."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from queue import Empty
from typing import Any

import torch.multiprocessing as mp


def rank_rows(worker: Callable[..., None], args: Any, world_size: int, rows: int) -> Iterator[Any]:
    """Runs ``worker(rank, args, store_path, queue)`` on ``world_size`` spawned
    processes and yields the first ``rows`` items put on ``queue``, as they
    come; exits with the failed ranks if any rank dies or fails."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=worker, args=(r, args, os.path.join(tmp, "store"), queue))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for _ in range(rows):
            yield _next_row(queue, procs)
        for p in procs:
            p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"ranks {failed} failed")


def _next_row(queue, procs) -> Any:
    """The next row from rank 0, failing fast if any rank died."""
    while True:
        try:
            return queue.get(timeout=2)
        except Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.terminate()
                raise SystemExit(f"ranks {dead} failed; see their tracebacks above") from None
