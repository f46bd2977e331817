"""specserve on Ray Serve (server/ray_serve.py): one local Ray cluster bound to 127.0.0.1 with two
replicas of the tiny model (n-gram speculation), shared by every test here. Greedy answers equal
the offline engine's plain decoding; requests go to the replica that holds their prefix; the
gateway gauges come through; a replica killed under load loses no request silently."""

import json
import os
import socket
import threading

import httpx
import pytest
import ray

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.server import ray_launcher, ray_serve
from specserve.server.launcher import allowed_hosts

pytestmark = pytest.mark.slow  # a Ray cluster starts in ~30-60 s on two cores

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
MAX_MODEL_LEN = 512
REPLICA = ray_serve.REPLICA_HEADER


def words(*ids: int) -> str:
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture(scope="module")
def url(tiny):
    pythonpath = os.environ.get("PYTHONPATH")
    ray_launcher.start_ray("local", num_cpus=2)
    try:
        local = allowed_hosts("127.0.0.1", None)
        # A batch of 8: the 8 streams of the kill test all run at once, whichever replicas they go to.
        spec = ray_serve.ReplicaSpec(load={"model": tiny["target"]}, engine={"max_num_seqs": 8,
                                                                             "max_model_len": MAX_MODEL_LEN},
                                     speculative=NGRAM, server={"allowed_hosts": local}, served_model_names=("tiny",),
                                     max_waiting=16)
        options = ray_serve.DeploymentOptions(num_replicas=2, cpus_per_replica=1, max_ongoing_requests=24,
                                              grace_period_s=5, chunk_chars=64, imbalance=4)
        guard = {"api_key": None, "max_body_bytes": 2 << 20, "body_timeout_s": 10.0, "allowed_hosts": local}
        yield ray_serve.deploy(spec, options, guard, "127.0.0.1", _free_port(), "specserve-test")
    finally:
        # The local cluster goes whole: Serve's graceful shutdown (stop_ray, for a cluster the
        # command joined) drained nothing here and took ~3-6 s.
        ray.shutdown()
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath


@pytest.fixture(scope="module")
def offline(tiny):
    """Plain greedy decoding of the same model: what every replica must answer."""
    return LLM(loaded=tiny["loaded"], max_num_seqs=8, max_model_len=MAX_MODEL_LEN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(url: str, prompt: str, n: int = 16) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_prompts_go_to_the_replica_holding_their_prefix(url):
    """Fresh prefixes alternate between the two replicas (the one holding fewer goes first);
    a prompt that extends one goes where that one went."""
    prefixes = [words(*range(k, k + 30)) for k in (2, 12, 22, 32)]  # ~110 characters: one whole 64-char chunk and more
    first = [complete(url, p).headers[REPLICA] for p in prefixes]
    assert len(set(first)) == 2 and first[0] == first[2] != first[1] == first[3]
    again = [complete(url, p + " t7 t8 t9").headers[REPLICA] for p in prefixes]
    assert again == first


def test_greedy_answers_equal_the_offline_engine(url, offline):
    """Completions and chat, whole and streamed, through the ingress and either replica (with
    n-gram speculation) equal plain greedy decoding offline."""
    prompts = [words(5, 6, 7, 8, 9, 5, 6, 7), words(40, 41, 42), words(3, 3, 3), words(63, 1, 62, 2, 61)]
    want = [o.outputs[0].text for o in offline.generate(prompts, greedy(24), use_tqdm=False)]
    got, replicas = [], set()
    for p in prompts:
        r = complete(url, p, 24)
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
        replicas.add(r.headers[REPLICA])
    assert got == want and len(replicas) == 2

    messages = [{"role": "system", "content": words(3, 4)}, {"role": "user", "content": words(5, 6, 7, 5, 6, 7)}]
    chat_want = offline.chat(messages, greedy(20), use_tqdm=False)[0].outputs[0].text
    body = {"messages": messages, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.json()["choices"][0]["message"]["content"] == chat_want
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=120) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == chat_want


def test_gateway_gauges_come_through(url):
    text = httpx.get(f"{url}/metrics", timeout=60).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm:"):
            values[name.split("{")[0]] = float(value)
    assert values["vllm:num_requests_waiting"] >= 0 and values["vllm:num_requests_running"] >= 0
    assert 0 <= values["vllm:kv_cache_usage_perc"] <= 1
    assert 'vllm:cache_config_info{block_size="16",model_name="tiny",' in text


def test_a_replica_killed_under_load_loses_no_request_silently(url, offline):
    """Eight streams; once each has its first chunk, the replica serving most of them is killed.
    Every stream ends with [DONE]: whole and equal to the offline answer, or, on the killed
    replica, with an error event saying the output is incomplete after a true prefix of it. Whole
    answers asked for right after (sent on to another replica if the router still picks the dead
    one) come from the live replica, right."""
    n = MAX_MODEL_LEN - 40  # long streams: they are mid-way when the kill lands
    prompts = [words(*range(k, k + 20)) for k in range(4, 44, 5)]  # 8 fresh prefixes
    want = [o.outputs[0].text for o in offline.generate(prompts, greedy(n), use_tqdm=False)]
    started = threading.Barrier(len(prompts) + 1, timeout=120)
    results: list[dict] = [{} for _ in prompts]

    def stream(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            results[i]["replica"] = r.headers[REPLICA]
            lines = (line for line in r.iter_lines() if line)
            events = [next(lines)]
            started.wait()
            events.extend(lines)
        results[i]["events"] = events

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait()
    replicas = [r["replica"] for r in results]
    victim = max(replicas, key=replicas.count)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    after = [complete(url, p, 24) for p in prompts[:4]]
    for t in threads:
        t.join(timeout=180)
        assert not t.is_alive(), "a stream hung after the replica was killed"

    cut = 0
    for i, r in enumerate(results):
        events = r["events"]
        assert events[-1] == "data: [DONE]", events[-3:]
        bodies = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        text = "".join(b["choices"][0]["text"] for b in bodies if "choices" in b)
        if "error" in bodies[-1]:
            cut += 1
            assert r["replica"] == victim
            assert bodies[-1]["error"]["code"] == "replica_failed" and "incomplete" in bodies[-1]["error"]["message"]
            assert want[i].startswith(text) and text != want[i]
        else:
            assert text == want[i] and bodies[-1]["choices"][0]["finish_reason"] == "length"
    assert cut >= 1  # the victim's streams had hundreds of tokens to go when it was killed
    assert [r.status_code for r in after] == [200] * 4
    assert [r.json()["choices"][0]["text"] for r in after] == [
        o.outputs[0].text for o in offline.generate(prompts[:4], greedy(24), use_tqdm=False)]
    assert all(r.headers[REPLICA] != victim for r in after)
