"""The engine behind a server: LLMEngine stepping in its own thread, requests in and outputs out
through asyncio.

The engine is not thread-safe and a step holds the GIL-releasing torch kernels for milliseconds,
so it runs on one dedicated thread and nothing else touches it. The event loop talks to that
thread through a command queue (add, abort) that the thread drains between steps; outputs travel
back with `loop.call_soon_threadsafe` into one asyncio.Queue per request.

A step's outputs are handed over at the start of the next step's forward pass (the engine's
`before_forward`), not as the step ends: the pass releases the GIL for milliseconds, so the
event loop wakes, writes its chunks and goes back to waiting while the pass runs. Handed over
at the step's end, the loop woke while the engine thread still ran the step's Python (commit,
schedule, the next batch) and the two traded the GIL: on one stream the loop's socket sends
took 0.74 ms each, waiting for it (docs/figures.md). When no pass follows (nothing left to run,
an abort to deliver after them, the thread stopping) they are handed over at once.

Figures that the server reads at any time (queue lengths, KV blocks) are published as an
immutable snapshot after every step, so a /metrics scrape never reads the scheduler while it
changes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from specserve.engine.engine import LLMEngine
from specserve.errors import SpecserveError
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger("specserve.engine")

# How long the idle engine thread sleeps between checks of its stop flag; commands wake it at once.
_IDLE_WAIT_S = 0.5

T = TypeVar("T")


def build_off_thread(build: Callable[[], T]) -> T:
    """`build()` (load the model, construct the engine) on a short-lived thread of its own ->
    its result; its exception is raised here.

    Why: the engine thread must be the process's only OpenMP master. The kernels' parallel
    regions (about 150 per pass) run on libgomp, which keeps a worker pool per thread that ever
    started a region. Loading on the main thread leaves the main thread's pool alive, and once a
    process holds more OpenMP threads than CPUs libgomp cuts its spin-wait to a few hundred
    cycles, so every region of the engine thread's passes sleeps and wakes through the kernel:
    one stream ran at a third of the offline engine's speed. A pool dies with its thread, so the
    builder thread's workers are gone before the engine thread starts.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = build()
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            box["error"] = e

    thread = threading.Thread(target=run, name="specserve-build", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


class QueueFullError(SpecserveError):
    """The waiting queue holds max_waiting requests already: the client should retry later."""


class EngineStoppedError(SpecserveError):
    """The engine is shutting down (or died) and takes no new requests."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    use_speculation: bool
    num_speculative_tokens: int | None
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # RequestOutput items, or one exception
    # Only the last output goes to the loop (a whole response reads nothing else): no wake-up of
    # the event loop per step, whose work would take a core from the kernels' parallel regions.
    final_only: bool = False


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _AbortAll:
    """Abort every request the engine holds; each stream gets its last output (finish_reason
    "abort")."""


class AsyncEngine:
    """`async for out in engine.generate(...)`: outputs of one request as the engine steps.

    Leaving the loop early (a client went away, a task was cancelled) aborts the request, so its
    KV blocks return to the pool. A caller that wants the request's last output (to count it)
    calls `abort` instead and reads the stream on: it ends with finish_reason "abort".
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None):
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0):
            raise ValueError(f"max_waiting={max_waiting!r} must be an integer >= 0 or None")
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[_Add | _Abort | _AbortAll] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _pending, the adds sent but not yet taken
        self._pending = 0
        self._streams: dict[str, _Add] = {}  # engine thread only
        self._held: list[RequestOutput] = []  # engine thread only: the last step's outputs, not handed over yet
        engine.before_forward = self._hand_over
        self._accepting = True
        self._stop = False
        self.error: BaseException | None = None  # set when a step failed: the engine is dead
        self.snapshot = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.error is None

    def stop_accepting(self) -> None:
        self._accepting = False

    def shutdown(self) -> None:
        """Stop the thread; requests still running are aborted and their streams end."""
        self._accepting = False
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    # ---- requests ----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       prompt: str | None = None, use_speculation: bool = True,
                       num_speculative_tokens: int | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of the request after each step that produced tokens for it; the last one has
        `finished` set. Raises the engine's own SpecserveError when the request is refused."""
        add = self.submit(request_id, prompt_token_ids, params, prompt, use_speculation, num_speculative_tokens)
        async for out in self.stream(add):
            yield out

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               prompt: str | None = None, use_speculation: bool = True,
               num_speculative_tokens: int | None = None, final_only: bool = False) -> _Add:
        """Queue a request now (refusals raise here, before any output is awaited); read its
        outputs with `stream`. Servers submit all choices of a request before awaiting any.
        final_only: the stream yields the finished output alone (RequestOutput is cumulative, so
        it holds the whole answer), sparing the event loop a wake-up per step."""
        if not self.accepting:
            raise EngineStoppedError("the server is shutting down and takes no new requests"
                                     if self.error is None else f"the engine stopped after an internal error: {self.error}")
        with self._lock:
            if self.max_waiting is not None:
                # Room for a full running batch plus max_waiting queued behind it; adds not yet
                # taken by the engine thread count as waiting.
                snap = self.snapshot
                in_flight = snap.num_running + snap.num_waiting + self._pending
                if in_flight >= self.engine.config.max_num_seqs + self.max_waiting:
                    raise QueueFullError(f"the server is at capacity: {self.engine.config.max_num_seqs} requests running "
                                         f"and {self.max_waiting} waiting (--max-waiting); retry later")
            self._pending += 1
        add = _Add(request_id, list(prompt_token_ids), params, prompt, use_speculation, num_speculative_tokens,
                   asyncio.get_running_loop(), asyncio.Queue(), final_only)
        self._send(add)
        return add

    async def stream(self, add: _Add) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await add.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(add.request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def abort_all(self) -> None:
        """End every request now (a shutdown's grace period ran out): each stream gets a last
        output with finish_reason "abort", after the tokens it already had."""
        self._send(_AbortAll())

    # The engine's checks of a request, for callers that must refuse it before submitting (a
    # server answers 400 before a stream starts). They read only the engine's fixed settings,
    # so any thread may call them.

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def speculative(self) -> bool:
        """Whether requests can speculate (the engine has a proposer)."""
        return self.engine.proposer is not None

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        self.engine.check_prompt(prompt_token_ids)

    def check_params(self, params: SamplingParams) -> None:
        self.engine.check_params(params)

    def _send(self, cmd: _Add | _Abort | _AbortAll) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()
                self._take_commands()
                if not self.engine.has_unfinished_requests():
                    self._hand_over()
                    self._publish()
                    self._wake.wait(_IDLE_WAIT_S)
                    continue
                outputs = self.engine.step()  # hands the last step's outputs over before its pass
                self._hand_over()  # a step without a pass left them here
                self._held = outputs
                self._publish()
        except BaseException as e:  # a bug in a step: fail every request loudly, take no more
            logger.exception("engine step failed; the engine stops")
            self.error = e
        finally:
            self._hand_over()
            self._take_commands()
            self._abort_all()
            self._publish()
            self.engine.before_forward = None

    def _take_commands(self) -> None:
        taken = 0
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                taken += 1
                self._add(cmd)
            elif isinstance(cmd, _AbortAll):
                self._hand_over()  # the tokens a stream already had come before its abort
                self._abort_all()
            else:
                self._hand_over()  # as above; a request that finished there is no longer aborted
                if cmd.request_id in self._streams:
                    self.engine.abort_request(cmd.request_id)
                    self._deliver(self.engine.output(cmd.request_id))
        if taken:
            # Publish before un-counting them: the taken adds must show in the snapshot's
            # waiting count first, or the capacity check could miss them for a moment.
            self._publish()
            with self._lock:
                self._pending -= taken

    def _add(self, add: _Add) -> None:
        if self._stop or self.error is not None:
            self._put(add, EngineStoppedError("the server is shutting down and takes no new requests"))
            return
        try:
            self.engine.add_request(add.request_id, add.prompt_token_ids, add.params, add.prompt,
                                    add.use_speculation, add.num_speculative_tokens)
        except Exception as e:  # a refusal, or a bug adding this one request: it fails alone
            if not isinstance(e, (SpecserveError, ValueError)):
                logger.exception("adding request %s failed", add.request_id)
            self._put(add, e)
            return
        self._streams[add.request_id] = add

    def _hand_over(self) -> None:
        """Deliver the held outputs of the last step (module note)."""
        held, self._held = self._held, []
        for out in held:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        add = self._streams.get(out.request_id)
        if add is None:
            return
        if out.finished:
            del self._streams[out.request_id]
            self.engine.pop_finished(out.request_id)
        elif add.final_only:
            return
        self._put(add, out)

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            out = self.engine.output(rid)
            if self.error is not None:
                add = self._streams.pop(rid)
                self.engine.pop_finished(rid)
                self._put(add, EngineStoppedError(f"the engine stopped after an internal error: {self.error}"))
            else:
                self._deliver(out)

    @staticmethod
    def _put(add: _Add, item: RequestOutput | BaseException) -> None:
        try:
            add.loop.call_soon_threadsafe(add.outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _publish(self) -> None:
        self.snapshot = self.engine.stats()
