"""Chat templates rendered in a worker process with a time limit: the server's renderer.

The sandbox (chat.py) bounds what a template builds, but not how long it runs: an empty nested
`for` loop calls no sandbox hook, and Python cannot interrupt a thread. So the server renders in
one small child process, started once and reused, which it kills and starts afresh when a render
passes RenderBounds.time_s; the child also caps its address space (RLIMIT_AS), so a template
that allocates without end gets a MemoryError there instead of taking the server's memory.

The child is a plain `python -c` process, not multiprocessing: spawning through multiprocessing
would import the `specserve` package (and with it the engine and torch, ~1.5 s and hundreds of MB)
and pickle its arguments. The child registers `specserve` and `specserve.tokenizer` as bare
packages, so it imports only this module, chat.py, errors.py and jinja2. Requests and replies are
length-prefixed JSON frames over its stdin/stdout; a normal chat costs ~0.1 ms of overhead.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from specserve.errors import PromptError
from specserve.tokenizer.chat import ChatTemplate, RenderBounds, TemplateBoundsError

_HEADER = struct.Struct(">I")  # the byte length of the JSON frame that follows
_CACHED_TEMPLATES = 8  # compiled templates the child keeps (a server has one)
_START_TIMEOUT_S = 60.0

_BOOT = """
import sys, types
for name, path in (("specserve", sys.argv[1]), ("specserve.tokenizer", sys.argv[1] + "/tokenizer")):
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
from specserve.tokenizer.render_worker import serve
serve(sys.argv[2])
"""


class RenderWorker:
    """Renders chat templates in a child process under `bounds`. Thread-safe: renders take turns
    (one child; a normal render takes well under a millisecond)."""

    def __init__(self, bounds: RenderBounds = RenderBounds()):
        self.bounds = bounds
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._closed = False

    def start(self) -> None:
        with self._lock:
            self._ensure_running()

    def close(self) -> None:
        """Stop the child now, also in the middle of a render (that render fails)."""
        self._closed = True
        proc = self._proc
        if proc is not None:
            proc.kill()
            proc.wait()

    def render(self, template: ChatTemplate, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """template.render(messages, add_generation_prompt, tools), with the same errors, run in the
        child; TemplateBoundsError when it takes longer than bounds.time_s or the child dies."""
        request = json.dumps({"source": template.source, "special_tokens": dict(template.special_tokens),
                              "messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools},
                             ensure_ascii=False).encode()
        with self._lock:
            if self._closed:
                raise TemplateBoundsError("the chat template renderer is stopped (the server is shutting down)")
            proc = self._ensure_running()
            proc.stdin.write(_HEADER.pack(len(request)) + request)
            proc.stdin.flush()
            deadline = time.monotonic() + self.bounds.time_s
            try:
                header = _read(proc.stdout.fileno(), _HEADER.size, deadline)
                reply = json.loads(_read(proc.stdout.fileno(), _HEADER.unpack(header)[0], deadline))
            except TimeoutError:
                self._restart()
                raise TemplateBoundsError(f"the model's chat template exceeded its {self.bounds.time_s:g} s render "
                                          "limit on these messages (a template that loops without end?)") from None
            except EOFError:
                code = proc.wait()
                self._restart()
                raise TemplateBoundsError(f"the chat template render process ended (exit status {code}) while "
                                          "rendering these messages") from None
        return _result(reply)

    def _ensure_running(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            root = str(Path(__file__).resolve().parents[1])
            # close_fds: the child must not hold the server's listening socket open.
            self._proc = subprocess.Popen([sys.executable, "-c", _BOOT, root, json.dumps(asdict(self.bounds))],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
            # The child says when it is ready (an empty frame), so its start-up (~50 ms, more on
            # a loaded machine) never counts against a render's time limit.
            try:
                _read(self._proc.stdout.fileno(), _HEADER.size, time.monotonic() + _START_TIMEOUT_S)
            except (TimeoutError, EOFError):
                self._proc.kill()
                self._proc.wait()
                raise TemplateBoundsError(f"the chat template render process did not start within "
                                          f"{_START_TIMEOUT_S:g} s") from None
        return self._proc

    def _restart(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._proc = None
        if not self._closed:
            self._ensure_running()  # the next request finds it ready


def _read(fd: int, n: int, deadline: float) -> bytes:
    """n bytes from fd by the deadline (TimeoutError), or EOFError when the child has gone."""
    chunks, left = [], n
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _result(reply: Mapping) -> str:
    """The text of a reply, or its error raised as the exception the in-process render raises."""
    if "text" in reply:
        return reply["text"]
    kind, message = reply["error"], reply["message"]
    if kind == "bounds":
        raise TemplateBoundsError(message)
    raise PromptError(message)


# ---- the child -------------------------------------------------------------------------------------


def serve(bounds_json: str) -> None:
    """The child's loop: read a request frame from stdin, write its reply frame to stdout, until
    stdin closes (the server went away)."""
    import resource

    bounds = RenderBounds(**json.loads(bounds_json))
    resource.setrlimit(resource.RLIMIT_AS, (bounds.max_memory_bytes, bounds.max_memory_bytes))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames goes to the parent
    templates: dict[tuple, ChatTemplate] = {}
    stdout.write(_HEADER.pack(0))  # ready
    stdout.flush()
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        frame = stdin.read(_HEADER.unpack(header)[0])
        reply = json.dumps(_reply(templates, bounds, frame), ensure_ascii=False).encode()
        stdout.write(_HEADER.pack(len(reply)) + reply)
        stdout.flush()


def _reply(templates: dict[tuple, ChatTemplate], bounds: RenderBounds, frame: bytes) -> dict:
    try:
        request = json.loads(frame)
        key = (request["source"], tuple(sorted(request["special_tokens"].items())))
        if key not in templates:
            if len(templates) >= _CACHED_TEMPLATES:
                templates.clear()
            templates[key] = ChatTemplate(request["source"], request["special_tokens"], bounds)
        return {"text": templates[key].render(request["messages"], request["add_generation_prompt"],
                                                      request["tools"])}
    except TemplateBoundsError as e:
        return {"error": "bounds", "message": str(e)}
    except MemoryError:
        return {"error": "bounds", "message": f"the model's chat template ran out of memory (the render limit is "
                                              f"{bounds.max_memory_bytes >> 20} MiB)"}
    except Exception as e:  # PromptError, or what a template's own code raises (a TypeError...) on these messages
        message = str(e) if isinstance(e, PromptError) else f"the chat template failed: {type(e).__name__}: {e}"
        return {"error": "prompt", "message": message}
