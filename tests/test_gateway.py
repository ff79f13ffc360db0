"""Two CPU replicas of the embedded model behind the smg gateway
(`smg launch --worker-urls ...`), sharing one --file-storage-path: the
gateway registers both and serves chat, completions, /generate and
streams through them, spreads requests over both, keeps a prompt prefix
on the replica that has it cached, and serves everything from the other
replica once one is killed. A batch runs in one replica only, and the
other finishes it when its runner dies."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, free_port
from tests.slow import slow

pytestmark = [*slow, pytest.mark.skipif(shutil.which("smg") is None, reason="the smg gateway is not installed")]

REPLICA = ("--max-total-tokens", "8192")


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("shared-storage")


@pytest.fixture(scope="module")
def replicas(storage):
    started = [ServerProcess(*REPLICA, "--file-storage-path", str(storage)) for _ in range(2)]
    yield started
    for srv in started:
        if srv.proc.poll() is None:
            srv.stop()


@contextlib.contextmanager
def gateway(replicas, policy: str):
    """`smg launch` over the replicas; its base URL once both are healthy."""
    port = free_port()
    proc = subprocess.Popen(
        ["smg", "launch", "--worker-urls", *(r.base_url for r in replicas), "--policy", policy,
         "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
         "--shutdown-grace-period-secs", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, "smg exited"
            with contextlib.suppress(httpx.HTTPError):
                workers = httpx.get(f"{base}/workers", timeout=2).json()["workers"]
                if sum(w["is_healthy"] for w in workers) == len(replicas):
                    break
            assert time.time() < deadline, "the gateway did not register both replicas"
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def posts(srv: ServerProcess) -> int:
    return srv.log().count('"POST /v1/')


def test_every_route_through_the_gateway_and_both_replicas_used(replicas):
    with gateway(replicas, "cache_aware") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
        model = client.models.list().data[0].id
        before = [posts(r) for r in replicas]
        for i in range(16):  # prompts that share nothing: the gateway balances them
            chat = client.chat.completions.create(model=model, max_tokens=2, messages=[
                {"role": "user", "content": f"Topic {i}: {'lorem ipsum ' * (i + 1)}"}])
            assert chat.choices[0].finish_reason == "length"
        text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3).choices[0].text
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True) if c.choices)
        native = httpx.post(f"{base}/generate", json={"text": "Once upon a time",
                                                       "sampling_params": {"max_new_tokens": 3}}, timeout=60)
        with httpx.stream("POST", f"{base}/generate", timeout=60, json={
                "text": "Hello", "sampling_params": {"max_new_tokens": 3}, "stream": True}) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert text and streamed
    assert native.status_code == 200 and native.json()["meta_info"]["completion_tokens"] == 3
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][5:])["meta_info"]["completion_tokens"] == 3
    assert all(posts(r) > b for r, b in zip(replicas, before))  # both replicas served some


def follow_up_hits(base: str, groups: int = 3, per_group: int = 4) -> list[bool]:
    """For prompts sharing a long prefix, sent one after another: whether
    each follow-up found its prefix cached on the replica it reached."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    model = client.models.list().data[0].id  # the gateway routes by model name
    hits = []
    for g in range(groups):
        system = f"Policy {g} {time.time_ns()}: " + " ".join(f"rule{g}-{k}" for k in range(120))
        for q in range(per_group):
            usage = client.chat.completions.create(model=model, max_tokens=1, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": f"Question {q}?"}]).usage
            if q:
                hits.append(usage.prompt_tokens_details.cached_tokens >= 0.8 * usage.prompt_tokens)
    return hits


def test_cache_aware_routing_keeps_a_prefix_on_the_replica_that_has_it(replicas):
    with gateway(replicas, "cache_aware") as base:
        cache_aware = follow_up_hits(base)
    with gateway(replicas, "round_robin") as base:
        round_robin = follow_up_hits(base)
    assert all(cache_aware), cache_aware
    assert not all(round_robin)  # the control: without cache awareness some follow-ups miss


def batch_lines(n: int, tokens: int) -> bytes:
    return "\n".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": tokens,
                 "ignore_eos": True}}) for i in range(n)).encode()


def output_ids(client: openai.OpenAI, batch) -> list[str]:
    return sorted(json.loads(x)["custom_id"] for x in client.files.content(batch.output_file_id).text.splitlines())


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 600):
    deadline = time.time() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled"):
        assert time.time() < deadline, batch
        time.sleep(0.3)
    return batch


def test_a_batch_on_the_shared_storage_runs_once(replicas):
    a, b = (openai.OpenAI(base_url=f"{r.base_url}/v1", api_key="x") for r in replicas)
    upload = a.files.create(file=("in.jsonl", batch_lines(16, 4)), purpose="batch")
    batch = a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.files.retrieve(upload.id).bytes == upload.bytes  # the other replica sees the file
    done = finished(b, batch.id)  # and the batch
    assert done.status == "completed" and done.request_counts.completed == 16
    assert output_ids(b, done) == sorted(f"r{i}" for i in range(16))  # each line once


def test_killing_a_replica_mid_load(replicas):
    """Every request after the kill is served by the survivor; the batch the
    dead replica ran is finished by the survivor, each line once."""
    survivor, victim = replicas
    victim_client = openai.OpenAI(base_url=f"{victim.base_url}/v1", api_key="x")
    upload = victim_client.files.create(file=("in.jsonl", batch_lines(24, 24)), purpose="batch")
    batch = victim_client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
    with gateway(replicas, "cache_aware") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        killed = threading.Event()
        after_kill: list[str] = []

        def load():
            for i in range(40):
                sent_after_kill = killed.is_set()
                try:
                    client.chat.completions.create(model=model, max_tokens=2, messages=[
                        {"role": "user", "content": f"Request {i}: {'words ' * (i % 7)}"}])
                    outcome = "ok"
                except openai.APIError as e:
                    outcome = type(e).__name__
                if sent_after_kill:
                    after_kill.append(outcome)

        loader = threading.Thread(target=load)
        loader.start()
        while victim_client.batches.retrieve(batch.id).request_counts.completed < 2:
            time.sleep(0.1)
        victim.proc.send_signal(signal.SIGKILL)
        killed.set()
        victim.proc.wait(timeout=30)
        loader.join(timeout=600)
    assert len(after_kill) >= 10 and set(after_kill) == {"ok"}, after_kill
    survivor_client = openai.OpenAI(base_url=f"{survivor.base_url}/v1", api_key="x")
    done = finished(survivor_client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 24
    assert output_ids(survivor_client, done) == sorted(f"r{i}" for i in range(24))
