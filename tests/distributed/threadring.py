"""Run context-parallel attention for every rank of a ring in one process, one thread per rank.

The ring's point-to-point transfers go through in-memory queues instead of a process group, so the
production loop (``attncomp.distributed``: block schedule, merges, the backward's travelling
accumulators) runs unchanged on one device: this is how the GPU path (flash-style block backwards on
the Triton backend) is checked on a machine with a single GPU.
"""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager
from unittest import mock

from attncomp import distributed as D


class _Mailboxes:
    def __init__(self, world: int):
        self.world = world
        self.boxes = [queue.Queue() for _ in range(world)]
        self.local = threading.local()


class _QueueRing:
    def __init__(self, mail: _Mailboxes, rank: int):
        self.mail, self.rank = mail, rank

    def start(self, tensors):
        self.mail.boxes[(self.rank + 1) % self.mail.world].put([t.clone() for t in tensors])
        return _QueuePending(self.mail.boxes[self.rank])


class _QueuePending:
    def __init__(self, box):
        self.box = box

    def wait(self):
        return self.box.get(timeout=600)  # first calls on a GPU may compile kernels for minutes


@contextmanager
def thread_ring(world: int):
    """Inside: ``run(fn)`` calls ``fn(rank)`` in ``world`` threads, each seeing itself as rank
    ``rank`` of a ring of ``world``; returns the results by rank (re-raising a thread's error)."""
    mail = _Mailboxes(world)

    def group_info(group):
        return world, mail.local.rank, list(range(world))

    def ring(group, w, rank, members):
        return _QueueRing(mail, rank)

    def run(fn):
        results, errors = [None] * world, [None] * world

        def body(r):
            mail.local.rank = r
            try:
                results[r] = fn(r)
            except BaseException as e:  # re-raised below with its rank
                errors[r] = e

        threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            raise RuntimeError("; ".join(f"rank {r} failed: {type(e).__name__}: {e}" for r, e in failed)) from failed[0][1]
        if any(t.is_alive() for t in threads):
            raise TimeoutError("a rank did not finish")
        return results

    with mock.patch.object(D, "_group_info", group_info), mock.patch.object(D, "_Ring", ring):
        yield run
