"""The OpenAI-compatible server against the official `openai` client, on a real uvicorn server on a free port,
over a tiny float32 Llama built here: its answers equal `LLM.generate`'s, streamed or not, alone or with many
clients at once; bad input is a 4xx with OpenAI's error body; a client gone mid-stream frees its KV."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the openai client's HTTP library
import numpy as np
import openai
import pytest

from jax_offload import LLM, SamplingParams
from jax_offload.serving import async_engine
from jax_offload.serving.api_server import create_app, serve_in_background
from jax_offload.serving.async_engine import EngineProcess
from tests.tiny_models import WORDS, build_in

NAME = "tiny"
MAX_MODEL_LEN = 512
ENGINE = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=64, max_num_batched_tokens=1024,
              attention_impl="xla")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_in(tmp_path_factory, "llama3", seed=7)


@pytest.fixture(scope="module")
def reference(model_dir):
    """A second engine over the same weights: `LLM.generate`'s answers."""
    return LLM(model_dir, **ENGINE)


@contextlib.contextmanager
def serving(app):
    """A real uvicorn server for `app` on a free port of 127.0.0.1, on a thread: its base URL."""
    with serve_in_background(app) as (url, _):
        yield url


@pytest.fixture(scope="module")
def server(model_dir):
    llm = LLM(model_dir, **ENGINE)
    with serving(create_app(llm, NAME)) as url:
        yield url, llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def idle(llm: LLM, timeout: float = 30.0) -> None:
    """Waits until the server's engine holds no request and no KV block."""
    deadline = time.monotonic() + timeout
    while True:
        load = llm.load()
        if not llm.has_unfinished() and load.kv_blocks_used == 0 and load.swap_bytes_used == 0:
            return
        assert time.monotonic() < deadline, f"the engine still holds {load} after {timeout} s"
        time.sleep(0.05)


def test_completions_streamed_and_not_equal_generate(client, reference):
    seed = 1
    rng = random.Random(seed)
    prompts = [words(rng, n) for n in (3, 17, 40)]
    expected = reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, want in zip(prompts, expected):
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={
            "ignore_eos": True})
        assert got.choices[0].text == want.text, f"seed {seed}"
        assert got.usage.completion_tokens == len(want.token_ids) == 12
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text, f"seed {seed}"
        assert chunks[-1].usage.completion_tokens == 12
    # Several prompts in one request, as token ids: one choice each, in order.
    ids = [reference.encode(p) for p in prompts]
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in expected]
    assert [c.model_extra["token_ids"] for c in got.choices] == [w.token_ids for w in expected]


def test_chat_streamed_and_not_equal_generate(client, reference):
    messages = [{"role": "user", "content": "w4 w8 w15 w16 w23 w42"}]
    want = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    lp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                        top_logprobs=2, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert len(lp) == 3 and all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in lp)


def test_many_clients_at_once_equal_generate(server, reference):
    """32 clients send different prompts, lengths and seeds at once; each answer equals LLM.generate's."""
    seed = 2
    rng = random.Random(seed)
    jobs = [(words(rng, rng.randint(1, 120)), rng.randint(1, 24), rng.choice([0.0, 0.8]), rng.randint(0, 2**30))
            for _ in range(32)]
    expected = reference.generate([p for p, *_ in jobs], [
        SamplingParams(temperature=t, max_tokens=m, seed=s, ignore_eos=True) for _, m, t, s in jobs])

    async def main():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as aclient:
            async def one(prompt, max_tokens, temperature, s, stream):
                kwargs = dict(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=s,
                              extra_body={"ignore_eos": True})
                if not stream:
                    return (await aclient.completions.create(**kwargs)).choices[0].text
                return "".join([c.choices[0].text async for c in await aclient.completions.create(**kwargs,
                                                                                                     stream=True)])
            return await asyncio.gather(*(one(*job, stream=i % 2 == 0) for i, job in enumerate(jobs)))

    got = asyncio.run(main())
    assert got == [e.text for e in expected], f"seed {seed}"
    idle(server[1])


def test_echo_logprobs_equal_log_softmax_of_logits(client, reference):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0."""
    ids = reference.encode("w1 w2 w3 w5 w8 w13 w21 w34")
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=3, temperature=0)
    logits = reference.logits(ids).astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = [logp[i - 1, ids[i]] for i in range(1, len(ids))]
    lp = got.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-5)
    assert got.choices[0].text == reference.tokenizer.decode(ids)
    assert all(max(top.values()) == pytest.approx(logp[i].max(), abs=1e-5)
               for i, top in enumerate(lp.top_logprobs[1:]))
    # echo with a generated token: the prompt's log-probabilities, then the token's.
    more = client.completions.create(model=NAME, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert len(more.choices[0].logprobs.token_logprobs) == len(ids) + 1
    np.testing.assert_allclose(more.choices[0].logprobs.token_logprobs[1:len(ids)], want, atol=1e-5)


def test_prompt_logprobs_top_tokens_equal_a_stable_sort_of_the_vocabulary():
    """The echo path's top-N (found without sorting the vocabulary) equals a full stable sort's first N, ties to the
    lower token id, against float64 NumPy; logits with many ties."""
    seed = random.randrange(2**31)
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, 5, (9, 300)).astype(np.float32)
    ids = rng.integers(0, 300, 9).tolist()
    logp = logits.astype(np.float64) - logits.astype(np.float64).max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    for n in (0, 1, 7, 300):
        got = async_engine.prompt_logprobs(logits, ids, n)
        assert got[0] is None and len(got) == len(ids), seed
        for i in range(1, len(ids)):
            want = np.argsort(-logp[i - 1], kind="stable")[:n]
            assert [t for t, _ in got[i].top] == want.tolist(), (seed, n, i)
            assert got[i].logprob == logp[i - 1, ids[i]], (seed, n, i)


BAD = [
    ("not json", '{"prompt": ', "not valid JSON"),
    ("wrong type", {"prompt": "w1", "max_tokens": "many"}, "max_tokens"),
    ("max_tokens < 1", {"prompt": "w1", "max_tokens": 0}, "max_tokens must be >= 1"),
    ("temperature < 0", {"prompt": "w1", "temperature": -0.5}, "temperature must be >= 0"),
    ("too long", {"prompt": " ".join(["w1"] * 500), "max_tokens": 20}, "500 tokens and max_tokens is 20"),
    ("unknown model", {"model": "gpt-9", "prompt": "w1"}, "'gpt-9' does not exist"),
    ("n > 1", {"prompt": "w1", "n": 2}, "n must be 1"),
    ("token outside vocab", {"prompt": [5, 999999]}, "Token id 999999 is outside"),
]


@pytest.mark.parametrize("case, body, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_with_openai_error_body(server, case, body, message):
    url = server[0] + "/v1/completions"
    content = body if isinstance(body, str) else json.dumps({"model": NAME, "max_tokens": 4, **body})
    r = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=120)
    assert 400 <= r.status_code < 500, (case, r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"], (case, error)
    assert httpx.get(server[0] + "/health").status_code == 200


def test_disconnect_mid_stream_frees_its_blocks(server):
    url, llm = server
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": NAME, "prompt": "w3 " * 200, "max_tokens": 200, "stream": True, "ignore_eos": True},
                      timeout=120) as r:
        events = (line for line in r.iter_lines() if line)
        for _ in range(3):
            assert next(events).startswith("data: ")
        assert llm.load().kv_blocks_used > 0  # the request holds KV while it streams
    idle(llm)


def test_disconnect_frees_the_host_store_offloaded(model_dir):
    """Offloaded, a request gone mid-stream lets go of its stored blocks and its GPU tail slot at once."""
    llm = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, offload=True, block_size=16,
              num_ring_slots=4, attention_impl="xla")
    with serving(create_app(llm, NAME)) as url:
        body = {"model": NAME, "prompt": "w5 " * 40, "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for _ in range(3):
                assert next(line for line in lines if line).startswith("data: {")
            assert llm._runner.store.live_blocks(), "the request stores its blocks while it streams"
        idle(llm)
    assert llm._runner.store.live_blocks() == [] and llm.load().running == 0


def test_engine_failure_is_a_500_and_the_server_goes_on(server, client):
    url, llm = server
    engine = llm.request_engine()
    real = engine.runner.prefill

    def broken(seqs):
        engine.runner.prefill = real
        raise RuntimeError("injected")

    engine.runner.prefill = broken
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "w7 w8", "max_tokens": 4}, timeout=120)
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    assert client.completions.create(model=NAME, prompt="w7 w8", max_tokens=4).choices[0].text
    idle(llm)


def test_models_health_metrics_tokenize(server):
    url, _ = server
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == NAME
    assert httpx.get(url + "/health").status_code == 200
    tokens = httpx.post(url + "/tokenize", json={"prompt": "w1 w2 w3"}).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": tokens}).json()["prompt"] == "w1 w2 w3"
    metrics = httpx.get(url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "host_store_bytes_read"):
        assert f"jax_offload:{name}" in metrics, name


def test_api_key_is_required_when_set():
    # The key is checked before anything reaches the engine, so the app's engine is never started.
    app = create_app(EngineProcess(int), NAME, api_key="sekrit")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.get("/v1/models"), await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})

    missing, wrong = asyncio.run(main())
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"


def test_engine_in_its_own_process_equals_generate(model_dir, reference):
    """The CLI's way: the engine in a spawned process (`EngineProcess`); streamed == not == LLM.generate, and a
    client gone mid-stream frees its blocks there."""
    engine = EngineProcess(functools.partial(LLM, model_dir, **ENGINE))
    want = reference.generate(["w9 w8 w7"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]

    def load():
        return asyncio.run(engine.call(LLM.load))

    with serving(create_app(engine, NAME)) as url:
        body = {"model": NAME, "prompt": "w9 w8 w7", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        text = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                               if line.startswith("data: {"))
        long = {**body, "prompt": "w3 " * 10, "max_tokens": 490, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=120) as r:
            lines = r.iter_lines()  # kept: a dropped iterator would close the stream before the call below
            assert next(line for line in lines if line).startswith("data: {")
            held = load()
        deadline = time.monotonic() + 30
        while (after := load()).kv_blocks_used and time.monotonic() < deadline:
            time.sleep(0.05)
    assert text == streamed == want.text
    assert held.kv_blocks_used > 0 and after.kv_blocks_used == 0 and after.running == 0
    assert not engine.alive  # the app's shutdown ended the process


def test_engine_process_ends_with_its_parent():
    """A server killed while its engine process builds (here a build that would take 10 minutes) leaves no engine
    behind: the engine process ends within seconds."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import functools, threading, time\n"
         "from jax_offload.serving.async_engine import EngineProcess\n"
         "engine = EngineProcess(functools.partial(time.sleep, 600))\n"
         "threading.Thread(target=engine.start, daemon=True).start()\n"
         "while engine._process.pid is None: time.sleep(0.01)\n"
         "print(engine._process.pid, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        child = int(parent.stdout.readline())
        time.sleep(3)  # the child is past its imports, in its build
        assert _running(child), "the engine process ended before its parent"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _running(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"the engine process {child} outlived its killed parent by 20 s")


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_soak_1000_requests_64_clients(server, reference, capsys):
    """1,000 requests from 64 clients at once, a tenth bad and a tenth gone mid-stream: every good answer equals
    LLM.generate's, every bad one is a 4xx naming its problem, /health answers throughout, the KV pool is empty
    at the end and the process's RSS is flat."""
    url, llm = server
    seed = 3
    rng = random.Random(seed)
    kinds = ["bad" if i % 10 == 0 else "gone" if i % 10 == 5 else "good" for i in range(1000)]
    jobs = []
    for i, kind in enumerate(kinds):
        prompt, max_tokens = words(rng, rng.randint(1, 60)), rng.randint(1, 8)
        temperature, s, stream = rng.choice([0.0, 0.7]), rng.randint(0, 2**30), rng.random() < 0.5
        jobs.append((kind, prompt, max_tokens, temperature, s, stream, BAD[i // 10 % len(BAD)]))
    good = [j for j in jobs if j[0] == "good"]
    expected = iter(reference.generate([j[1] for j in good], [
        SamplingParams(temperature=j[3], max_tokens=j[2], seed=j[4], ignore_eos=True) for j in good]))
    want = {i: next(expected).text for i, j in enumerate(jobs) if j[0] == "good"}

    async def main():
        health: list[int] = []
        done = asyncio.Event()
        limit = asyncio.Semaphore(64)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=80)) as c:
            async def watch():
                while not done.is_set():
                    health.append((await c.get("/health")).status_code)
                    await asyncio.sleep(0.2)

            async def one(i, kind, prompt, max_tokens, temperature, s, stream, bad):
                async with limit:
                    if kind == "bad":
                        _, body, message = bad
                        content = body if isinstance(body, str) else json.dumps({"model": NAME, "max_tokens": 4,
                                                                                 **body})
                        r = await c.post("/v1/completions", content=content,
                                         headers={"content-type": "application/json"})
                        return r.status_code, r.json()["error"]["message"], message
                    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens if kind == "good" else 64,
                            "temperature": temperature, "seed": s, "ignore_eos": True, "stream": stream or
                            kind == "gone"}
                    if not body["stream"]:
                        return (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
                    text = []
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if not line or line == "data: [DONE]":
                                continue
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                            if kind == "gone" and len(text) == 2:
                                break  # the client leaves: the connection closes
                    return "".join(text)

            watcher = asyncio.ensure_future(watch())
            first = await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs[:200])))
            idle(llm)
            rss_warm = rss_bytes()
            rest = await asyncio.gather(*(one(i + 200, *job) for i, job in enumerate(jobs[200:])))
            done.set()
            await watcher
            return first + rest, health, rss_warm

    results, health, rss_warm = asyncio.run(main())
    idle(llm)
    rss_end = rss_bytes()
    for i, (job, got) in enumerate(zip(jobs, results)):
        if job[0] == "good":
            assert got == want[i], f"request {i}, seed {seed}"
        elif job[0] == "bad":
            status, message, expected_message = got
            assert 400 <= status < 500 and expected_message in message, (i, status, message)
    assert health and all(code == 200 for code in health)
    assert llm.load().kv_blocks_used == 0 and not llm.has_unfinished()
    with capsys.disabled():
        print(f"\nsoak: RSS {rss_warm / 2**20:.1f} MiB after 200 requests, {rss_end / 2**20:.1f} MiB after 1,000; "
              f"/health answered {len(health)} times")
    assert rss_end - rss_warm < 64 * 2**20, f"RSS grew {(rss_end - rss_warm) / 2**20:.1f} MiB"


def test_engine_loop_holds_a_run_ahead_step_until_due_and_takes_requests_meanwhile():
    """The engine loop (`async_engine._drive`) with a step in flight: no step runs before the core says the next is
    due; a command that comes meanwhile is taken and its step runs at once, not at the due time."""
    import queue

    class Core:
        busy = True

        def __init__(self):
            self.due, self.events, self.stop = time.perf_counter() + 0.2, [], False

        def step_due(self):
            return self.due if time.perf_counter() < self.due else None

        def take(self, command):
            self.events.append(("take", time.perf_counter()))
            self.due = 0.0  # a waiting request: its step is due at once

        def run_once(self):
            self.events.append(("step", time.perf_counter()))
            if len(self.events) == 1:  # the first step: the next is due in 1 s unless a request comes
                self.due = time.perf_counter() + 1.0
            else:
                self.stop = True

    core, commands = Core(), queue.SimpleQueue()

    def get(timeout):
        return commands.get(timeout=timeout) if timeout != 0 else commands.get_nowait()

    began, first_due = time.perf_counter(), core.due
    threading.Timer(0.3, lambda: commands.put(("add",))).start()  # 0.9 s before the second step is due
    async_engine._drive(core, get, queue.Empty, lambda: core.stop)
    (first, t1), (take, t2), (second, t3) = core.events
    assert (first, take, second) == ("step", "take", "step")
    assert t1 >= first_due, f"the first step ran {(first_due - t1) * 1e6:.0f} us before it was due"
    assert 0.29 <= t2 - began < 0.9 and t3 - t2 < 0.05, "the request's step waited for the due time"
