"""Which requests run in the next step. Pure Python: the scheduler never touches tensors.

Requests are admitted first-come-first-served while cache slots are free. A step is either a
prefill of newly admitted requests or one decode (or verify) pass over every running request;
keeping the two apart means a decode batch is never padded to a prompt's length.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.engine.request import Request, Status


@dataclass(slots=True)
class SchedulerOutput:
    prefill: list[Request] = field(default_factory=list)  # compute their whole prompt, sample the first token
    decode: list[Request] = field(default_factory=list)  # compute the last token (+ drafts), sample the next

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, num_slots: int):
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop()
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
        if admitted:
            return SchedulerOutput(prefill=admitted)
        return SchedulerOutput(decode=list(self.running))

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's slot (a waiting one just leaves the queue)."""
        if request in self.running:
            self.running.remove(request)
            self.free_slots.append(request.slot)
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)
