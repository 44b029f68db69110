"""`ferry serve router --engines vllm` in front of real vLLM engines that load FerryConnector:
what a client of the router notices. Through the router (the real binary), in push mode and in
pull mode, completions and chat completions, streamed and not, give the same text and token ids
as vLLM computing them alone, and ferry moved the KV (its byte counters in the engines'
/metrics, and decode's vLLM counting the prompt as transferred). A router whose mode differs
from its prefill engine's is not ready and says which flag to change; bad requests get a 400
naming the field; every wait has a deadline.

Two vLLM engines of the tiny model, both with FerryConnector: A runs "mode": "push", B "mode":
"pull" (an engine's mode is what its prefill requests do; a decode engine follows each request's
kv_transfer_params). The push router sends prefill legs to A and decode legs to B, the pull
router the other way round, so the two modes need no more engines than test_pd's one pair. The
baseline is B answering the request alone (no kv_transfer_params: vLLM computes it; test_pd
checks that this equals an engine without a connector). Both engines' kv_load_failure_policy is
"fail": a transfer that fails is an error, never a right answer computed locally.

Runs where vLLM is installed (build/vllm-venv: scripts/vllm_venv.sh; ctest's vllm_router) and
the ferry binary is built; 6 min 20 s on the 2-core dev machine at a load average of 22 (eight
other vLLM engines running), most of it the two engines starting."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/vllm_venv.sh)")

from test_pd import (  # noqa: E402  (the engines and helpers of test_pd, shared)
    BLOCK, LEASE, OP_TIMEOUT, PREFILL_LEASE, ROOT, START_DEADLINE, Engine, engine_log_tails,
    free_port)

__all__ = ["engine_log_tails"]  # conftest.py prints the engines' log tails of a failed test

MAX_TOKENS = 16
REQUEST_DEADLINE = 300.0
ROUTER_READY_DEADLINE = 60.0


def ferry_binary() -> str:
    """FERRY_BIN, else build/ferry beside the build tree's python package, else build/ferry."""
    import ferry

    for p in (os.environ.get("FERRY_BIN"), Path(ferry.__file__).resolve().parents[2] / "ferry",
              Path(ROOT) / "build" / "ferry"):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return str(p)
    pytest.skip("no ferry binary (build it: cmake --build build --target ferry)")


class Router:
    """`ferry serve router` as a user starts it; its log in a file."""

    def __init__(self, workdir, name, *args):
        self.port = free_port()
        self.log_path = os.path.join(workdir, f"router-{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [ferry_binary(), "serve", "router", "--host", "127.0.0.1", "--port", str(self.port),
             *args], stdout=self.log, stderr=subprocess.STDOUT)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def health(self):
        """(HTTP status, body) of its /health; (0, why) while it does not answer."""
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, OSError) as e:
            return 0, str(e)

    def wait_health(self, want_ok, deadline_s=ROUTER_READY_DEADLINE):
        """Polls /health until it is 200 (want_ok) or answers non-200 with a reason naming an
        engine's state; returns (status, body) of the last answer."""
        deadline = time.monotonic() + deadline_s
        status, body = 0, ""
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the router exited: {self.tail()}"
            status, body = self.health()
            if want_ok and status == 200:
                return status, body
            if not want_ok and status not in (0, 200) and "not probed yet" not in body:
                return status, body
            time.sleep(0.5)
        return status, body

    def tail(self):
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    binary = ferry_binary()  # skips before any engine starts when there is none
    work = str(tmp_path_factory.mktemp("vllm_router"))
    model = os.path.join(work, "tiny-model")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_model.py"), model],
                   check=True, capture_output=True, timeout=300)

    def kv(mode):
        return {"kv_connector": "FerryConnector", "kv_connector_module_path": "ferry.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {
                    "mode": mode, "port": free_port(), "op_timeout": OP_TIMEOUT,
                    "provider": os.environ.get("FERRY_VLLM_PROVIDER", "tcp"),
                    # each engine is prefill for one router and decode for the other
                    "lease": max(LEASE, PREFILL_LEASE)}}

    t0 = time.monotonic()
    a = Engine("push-engine", model, work, kv_config=kv("push"))
    b = Engine("pull-engine", model, work, kv_config=kv("pull"))
    routers = []
    try:
        deadline = time.monotonic() + START_DEADLINE
        for e in (a, b):
            e.wait_ready(deadline)
        for e in (a, b):  # warm up: an engine's first request is slow
            local(e, "/v1/completions", {"prompt": "warm up", "max_tokens": 2})
        print(f"two vLLM engines ready and warm in {time.monotonic() - t0:.0f} s ({binary})")

        def router(name, mode, prefill, decode, engines="vllm"):
            r = Router(work, name, "--engines", engines, "--mode", mode,
                       "--prefill", f"127.0.0.1:{prefill.port}",
                       "--decode", f"127.0.0.1:{decode.port}")
            routers.append(r)
            return r

        yield a, b, router
    finally:
        for r in routers:
            r.stop()
        for e in (a, b):
            e.stop()
        if os.environ.get("FERRY_VLLM_KEEP_LOGS"):
            print(f"engine and router logs kept in {work}")
        else:
            shutil.rmtree(os.path.join(work, "tiny-model"), ignore_errors=True)


def post(url, body, stream=False):
    """(HTTP status, JSON answer or the list of streamed events, or the error body)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode()
                                 if not isinstance(body, bytes) else body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_DEADLINE) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    if not stream:
        return status, json.loads(raw)
    events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {raw[-500:]}"
    return status, [json.loads(e) for e in events[:-1]]


def request(path, base):
    return dict(base, model="tiny", temperature=0.0, ignore_eos=True, return_token_ids=True,
                **({} if "max_tokens" in base else {"max_tokens": MAX_TOKENS}))


def answer(path, got):
    """(text, token ids) of a completion or chat completion, streamed (a list of events) or
    not. Streamed token ids: those of the events that carry them (vLLM's return_token_ids)."""
    chat = path.endswith("chat/completions")
    if isinstance(got, list):
        text, ids = "", []
        for ev in got:
            for c in ev.get("choices", []):
                text += (c.get("delta", {}).get("content") or "") if chat else c.get("text", "")
                ids += c.get("token_ids") or []
        return text, ids
    c = got["choices"][0]
    return (c["message"]["content"] if chat else c["text"]), c.get("token_ids")


def local(engine, path, base):
    status, got = post(engine.url(path), request(path, base))
    assert status == 200, f"{engine.name} alone: HTTP {status}: {got}"
    return answer(path, got)


def ferry_counters(engine):
    """(bytes received, bytes posted): FerryConnector's counters in the engine's /metrics,
    read until they stop changing (the worker reports a step's bytes with the step)."""
    last = None
    for _ in range(20):
        now = (engine.metric("vllm:ferry_bytes_received_total"),
               engine.metric("vllm:ferry_bytes_posted_total"),
               engine.metric("vllm:prompt_tokens_by_source_total",
                             source="external_kv_transfer"))
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    return last


# A prompt of several blocks, as text (the tiny model's tokenizer knows these words) and as chat.
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog and runs far away"] * 12)
CASES = (
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "You answer."},
                                           {"role": "user", "content": PROMPT}]}),
)


def check_mode(cluster, mode):
    a, b, router = cluster
    prefill, decode = (a, b) if mode == "push" else (b, a)
    r = router(mode, mode, prefill, decode)
    status, body = r.wait_health(want_ok=True)
    assert status == 200, f"the {mode} router is not ready: {body}\n{r.tail()}"
    assert json.loads(body)["prefill"][0]["connector"]["mode"] == mode, body
    for path, base in CASES:
        want = local(b, path, base)
        assert want[0], f"the baseline answered no text for {path}"
        for stream in (False, True):
            label = f"{mode} {path} {'streamed' if stream else 'not streamed'}"
            p_before, d_before = ferry_counters(prefill), ferry_counters(decode)
            status, got = post(r.url(path), request(path, dict(base, stream=stream)), stream)
            assert status == 200, f"{label}: HTTP {status}: {got}\n{r.tail()}"
            text, ids = answer(path, got)
            assert text == want[0], f"{label}: {text!r} != baseline {want[0]!r}"
            if ids and want[1]:
                assert ids == want[1], f"{label}: token ids {ids} != baseline {want[1]}"
            p_now, d_now = ferry_counters(prefill), ferry_counters(decode)
            # Decode: the KV arrived in its blocks, and its vLLM counted the prompt as moved.
            assert d_now[0] > d_before[0], f"{label}: no KV bytes arrived at decode"
            assert d_now[2] > d_before[2], f"{label}: decode's vLLM counted no transferred " \
                                           f"prompt tokens"
            # Push: prefill wrote them; pull: decode read them (prefill posts nothing).
            moved_by = p_now[1] - p_before[1] if mode == "push" else d_now[1] - d_before[1]
            assert moved_by > 0, f"{label}: ferry posted no bytes on the " \
                                 f"{'prefill' if mode == 'push' else 'decode'} engine"
    r.stop()


def test_push_router_gives_the_baseline(cluster):
    check_mode(cluster, "push")


def test_pull_router_gives_the_baseline(cluster):
    check_mode(cluster, "pull")


def test_a_router_of_another_mode_is_not_ready_and_names_the_flag(cluster):
    # A pull router over a push prefill engine, a push router over a pull one: never ready,
    # the reason names the router's --mode and the engine's "mode"; a request gets a 503 saying
    # the same rather than a 400 that blames the client.
    a, b, router = cluster
    for mode, prefill, decode, engine_mode in (("pull", a, b, "push"), ("push", b, a, "pull")):
        r = router(f"wrong-{mode}", mode, prefill, decode)
        status, body = r.wait_health(want_ok=False)
        assert status == 503, f"{mode} router over a {engine_mode} prefill: HTTP {status}: {body}"
        reason = json.loads(body).get("reason", "")
        assert f"--mode {mode}" in reason and f'"mode":"{engine_mode}"' in reason, body
        status, got = post(r.url("/v1/completions"), request("/v1/completions",
                                                              {"prompt": "hello"}))
        assert status == 503 and "--mode" in got, f"HTTP {status}: {got}"
        r.stop()
    # A router for ferry's engines in front of vLLM engines: not ready, names --engines vllm.
    r = router("ferry-kind", "push", a, b, engines="ferry")
    status, body = r.wait_health(want_ok=False)
    assert status == 503 and "--engines vllm" in body, f"HTTP {status}: {body}"


def test_bad_requests_get_a_400_naming_the_field(cluster):
    a, b, router = cluster
    r = router("bad-input", "push", a, b)
    status, body = r.wait_health(want_ok=True)
    assert status == 200, body
    t0 = time.monotonic()
    cases = (
        ("/v1/completions", b"{not json", "JSON"),
        ("/v1/completions", {"model": "tiny", "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"model": "tiny", "prompt": "hello"}, "messages"),
        # vLLM's own check, relayed: the decode leg's 400 reaches the client.
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    )
    for path, body, field in cases:
        status, got = post(r.url(path), body)
        assert status == 400 and field in got, f"{path} {body!r}: HTTP {status}: {got}"
    assert time.monotonic() - t0 < 120, "bad requests took minutes to be refused"
    # Nothing stuck: a good request after them is served.
    want = local(b, "/v1/completions", {"prompt": "after the bad ones", "max_tokens": 4})
    status, got = post(r.url("/v1/completions"),
                       request("/v1/completions", {"prompt": "after the bad ones",
                                                   "max_tokens": 4}))
    assert status == 200 and answer("/v1/completions", got)[0] == want[0], f"{status}: {got}"
