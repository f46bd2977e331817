"""The Ray Serve ingress's parts that need no cluster: the prefix index the router keeps, the text
it routes on, and what the ingress does when a replica dies (a stand-in deployment handle)."""

import asyncio
import json

from ray.exceptions import ActorDiedError

from specserve.server import ray_serve
from specserve.server.prefix_affinity import Match, PrefixIndex, chunk_hashes


def test_chunk_hashes_chain_whole_chunks():
    a, b = chunk_hashes("x" * 64 + "y" * 64 + "z", 64), chunk_hashes("x" * 64 + "w" * 64, 64)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # the partial third chunk does not count
    assert chunk_hashes("short", 64) == chunk_hashes("short", 64) != chunk_hashes("shorter", 64)
    assert len(chunk_hashes("short", 64)) == 1 and chunk_hashes("", 64) == []


def test_index_finds_the_longest_prefix_on_a_live_replica():
    index = PrefixIndex(chunk_chars=4)
    index.record("aaaabbbbcccc", "r1")
    index.record("aaaabbbb", "r2")  # the two chunks it shares move to r2
    assert index.match("aaaabbbbccccdddd", {"r1", "r2"}) == Match("r1", 3)
    assert index.match("aaaabbbbxxxx", {"r1", "r2"}).replica == "r2"
    assert index.match("aaaabbbbcccc", {"r2"}).replica == "r2"  # r1 is not a candidate: r2's shorter match
    assert index.match("zzzz", {"r1", "r2"}).replica is None
    assert (index.held("r1"), index.held("r2")) == (1, 2)
    assert index.least_held({"r1", "r2", "r3"}) == "r3" and index.least_held({"r1", "r2"}) == "r1"
    index.forget("r2")
    assert index.match("aaaabbbbcccc", {"r1", "r2"}) == Match("r1", 3)  # r1 served all of it
    assert index.match("aaaabbbbxxxx", {"r1", "r2"}).replica is None  # its prefix was last served by r2 only
    assert index.held("r2") == 0


def test_index_drops_the_least_recently_recorded_beyond_its_bound():
    index = PrefixIndex(chunk_chars=2, max_chunks=3)
    index.record("aabb", "r1")
    index.record("ccdd", "r2")  # 4 chunks: aa goes
    assert index.match("aa", {"r1", "r2"}).replica is None and index.match("ccdd", {"r2"}).chunks == 2
    assert index.held("r1") + index.held("r2") == 3


def test_routing_text_is_what_the_prompt_begins_with():
    text = ray_serve.routing_text
    assert text("/v1/completions", json.dumps({"prompt": "hello"}).encode()) == "hello"
    assert text("/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode()) == "a"
    assert text("/v1/completions", json.dumps({"prompt": [5, 6, 7]}).encode()) == "5,6,7"
    assert text("/v1/completions", json.dumps({"prompt": [[5, 6], [7]]}).encode()) == "5,6"
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert text("/v1/chat/completions", json.dumps(chat).encode()) == "system:be brief\nuser:hi\n"
    assert text("/v1/completions", b"{not json") is None
    assert text("/v1/completions", b"[1, 2]") is None
    assert text("/v1/models", b"") is None and text("/metrics", b"") is None


# ---- the ingress when a replica dies ------------------------------------------------------------

SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


def answer(headers, *bodies: bytes) -> list[dict]:
    last = len(bodies) - 1
    return [{"type": "http.response.start", "status": 200, "headers": headers},
            *({"type": "http.response.body", "body": b, "more_body": i < last} for i, b in enumerate(bodies))]


class Replica:
    """A stand-in replica's answer: its messages, then (if `dies_after` is set) ActorDiedError
    after that many of them."""

    def __init__(self, messages: list[dict], dies_after: int | None = None):
        self.messages, self.dies_after, self.cancelled = messages, dies_after, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for i, m in enumerate(self.messages):
            if i == self.dies_after:
                raise ActorDiedError()
            yield m
        if self.dies_after is not None and self.dies_after >= len(self.messages):
            raise ActorDiedError()

    def cancel(self):
        self.cancelled = True


class Handle:
    """A stand-in deployment handle: each call is answered by the next replica in line."""

    def __init__(self, replicas: list[Replica]):
        self.replicas, self.calls = replicas, 0

    def options(self, **_):
        return self

    def remote(self, request):
        self.calls += 1
        return self.replicas.pop(0)


def forward(replicas: list[Replica]) -> tuple[list[dict], Handle]:
    """The messages the client gets for one completions request through an Ingress whose engine
    replicas answer as `replicas`."""
    handle = Handle(replicas)
    ingress = ray_serve.Ingress(handle, {})
    sent = []

    async def send(m):
        sent.append(m)

    async def receive():
        return {"type": "http.disconnect"}

    request = ray_serve.ForwardedRequest("POST", "/v1/completions", b"", [], b"{}", None, "x")
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(ingress.forward(request, scope, receive, send))
    return sent, handle


def body_of(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_replica_dying_before_it_answered_is_retried_on_another():
    whole = answer(JSON, b'{"ok": true}')
    # Died before anything, and after its start but before its body: the client saw nothing.
    sent, handle = forward([Replica([], dies_after=0), Replica(whole, dies_after=1), Replica(whole)])
    assert sent == whole and handle.calls == 3


def test_a_stream_whose_replica_dies_ends_with_an_error_event():
    replica = Replica(answer(SSE, b'data: {"choices": []}\n\n', b"data: more\n\n"), dies_after=2)
    sent, handle = forward([replica])
    events = [e for e in body_of(sent).decode().split("\n\n") if e]
    assert handle.calls == 1 and events[0] == 'data: {"choices": []}' and events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed" and "incomplete" in error["message"]
    assert "ActorDiedError" in error["message"]
    assert sent[-1]["more_body"] is False


def test_no_replica_left_answers_503_naming_the_failure():
    sent, handle = forward([Replica([], dies_after=0) for _ in range(ray_serve.ATTEMPTS)])
    assert handle.calls == ray_serve.ATTEMPTS
    assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    error = json.loads(body_of(sent))["error"]
    assert error["code"] == "replica_unavailable" and "ActorDiedError" in error["message"]


# ---- the command and the imports ----------------------------------------------------------------

def test_only_the_ray_serve_modules_import_ray():
    """Ray stays off every import path but serve-ray's: server/ray_serve.py imports it, and
    ray_launcher.py only inside the functions that run the command."""
    import ast
    from pathlib import Path

    import specserve

    root = Path(specserve.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n == "ray" or n.startswith("ray.") for n in names):
                found.setdefault(str(path.relative_to(root)), set()).add("module" if node in top else "function")
    assert found == {"server/ray_serve.py": {"module"}, "server/ray_launcher.py": {"function"}}


def test_serve_ray_without_ray_says_how_to_install_it(capsys, monkeypatch):
    import sys

    import specserve.server
    from specserve.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if it were not installed
    monkeypatch.delitem(sys.modules, "specserve.server.ray_serve")
    monkeypatch.delattr(specserve.server, "ray_serve")
    assert main(["serve-ray", "--num-replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'specserve[ray]'" in err and "Traceback" not in err


def test_serve_ray_names_a_bad_argument(capsys):
    from specserve.cli import main

    for argv, needle in ((["--num-replicas", "0"], "num_replicas"), (["--cpus-per-replica", "-1"], "cpus_per_replica"),
                         (["--route-chunk-chars", "0"], "route_chunk_chars"), (["--port", "70000"], "port")):
        assert main(["serve-ray", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.splitlines()[-1].startswith("specserve: error:")
