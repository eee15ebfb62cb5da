"""``traces.engine: openai`` against a real OpenAI-compatible server: ``transformers serve`` (continuous batching)
serving the embedded teacher on a free localhost port, started by the tests and stopped at the end."""

import json
import os
import re
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path

import pytest

from foresight.data import traces
from foresight.config.recipe import load_recipe
from foresight.engine.models import resolve_path
from foresight.data.openai_client import ServerClient, ServerError
from foresight.data.trace_data import load_traces
from benchmarks.servers import ServerProcess, free_port

pytestmark = pytest.mark.slow  # a real server process per test

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
TEACHER = resolve_path("builtin:tiny-qwen3")[0]
QUIET = dict(progress=False, log=lambda *_: None)


def Server(port: int, log: Path) -> ServerProcess:
    """``transformers serve`` serving the embedded teacher in float32 (16k cached tokens, not 80% of RAM)."""
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe) if exe.exists() else shutil.which("transformers"), "serve", TEACHER, "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--continuous-batching",
           "--cb-num-blocks", "512", "--log-level", "info"]
    return ServerProcess(cmd, port, log)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(free_port(), tmp_path_factory.mktemp("serve") / "server.log").start()
    yield s
    s.kill()


def recipe(**extra):
    sets = ["traces.num_prompts=8", "traces.batch_size=4", "traces.max_new_tokens=100", "traces.min_new_tokens=0",
            "traces.require_correct=false", "traces.loss_chunk=128"]
    return load_recipe("recipes/tiny-qwen3.yaml", sets + [f"{k}={v}" for k, v in extra.items()])


def remote(url, **extra):
    return recipe(**{"traces.engine": "openai", "traces.base_url": url, **extra})


class JsonHandler(BaseHTTPRequestHandler):
    """An HTTP handler that answers JSON bytes and keeps quiet."""

    def reply(self, status: int, raw: bytes):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


class Relay(JsonHandler):
    """Passes every request on to the server and counts those in flight at once: the concurrency the server was sent,
    measured outside it (what ``transformers serve`` logs per request changed in 5.25). The first ``hold`` POSTs wait
    (up to a minute) until all of them have arrived, so a short completion cannot finish before a slow thread's request
    lands on a loaded 2-core machine; a client that sends fewer at once leaves ``most`` below ``hold``."""

    upstream, lock, in_flight, most, hold, arrived, all_in = "", threading.Lock(), 0, 0, 0, 0, threading.Event()

    def do_GET(self):
        self._relay(None)

    def do_POST(self):
        self._relay(self.rfile.read(int(self.headers["Content-Length"])))

    def _relay(self, body):
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.most = max(cls.most, cls.in_flight)
            cls.arrived += body is not None
            if cls.arrived >= cls.hold:
                cls.all_in.set()
        if body is not None:
            cls.all_in.wait(timeout=60)
        req = urllib.request.Request(cls.upstream + self.path, data=body, method=self.command,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        finally:
            with cls.lock:
                cls.in_flight -= 1
        self.reply(status, raw)


@pytest.fixture
def relay(server):
    Relay.upstream, Relay.in_flight, Relay.most, Relay.hold, Relay.arrived = server.url.removesuffix("/v1"), 0, 0, 8, 0
    Relay.all_in = threading.Event()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield Relay, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_greedy_traces_through_the_server_equal_in_process_ones(relay, tmp_path):
    counter, url = relay
    here = traces.make_traces(recipe(), tmp_path / "hf", **QUIET)
    served = traces.make_traces(remote(url), tmp_path / "srv", **QUIET)
    a, b = load_traces(tmp_path / "hf"), load_traces(tmp_path / "srv")
    assert here["num_traces"] == served["num_traces"] == 8
    assert a["input_ids"] == b["input_ids"] and a["prompt_index"] == b["prompt_index"]
    assert a["token_loss"] == b["token_loss"]  # the same local full-cache pass
    assert served["max_in_flight"] == 8 and counter.most >= 8  # 8 requests reached the server at once
    meta = json.loads((tmp_path / "srv" / "meta.json").read_text())
    assert meta["engine"] == {"engine": "openai", "base_url": url, "server_model": TEACHER,
                              "request_style": "transformers", "concurrency": 8}
    assert json.loads((tmp_path / "hf" / "meta.json").read_text())["engine"] == {"engine": "hf"}
    again = traces.make_traces(remote(url), tmp_path / "srv", **QUIET)  # finished: nothing is sent
    assert again["requests_this_run"] == 0
    assert json.loads((tmp_path / "srv" / "meta.json").read_text())["engine"] == meta["engine"]


class GateRelay(Relay):
    """A relay that answers the client's one-token probe and the first batch's requests at once and holds each later
    one until a part file exists in ``parts`` (a scored batch), or 8 s: decoding slower than the scoring pass, made
    deterministic."""

    lock, in_flight, most, hold, arrived, all_in = threading.Lock(), 0, 0, 0, 0, threading.Event()
    parts, first = Path(), 5

    def do_POST(self):
        with self.lock:
            late = self.arrived >= self.first
        deadline = time.time() + 8
        while late and time.time() < deadline and not any(self.parts.glob("prompts-*.json")):
            time.sleep(0.05)
        super().do_POST()


def test_scoring_can_wait_for_every_completion(server, tmp_path):
    # scoring during decoding would write the first batch's part while the second batch is held at the relay
    out = tmp_path / "srv"
    GateRelay.upstream, GateRelay.parts = server.url.removesuffix("/v1"), out / "parts"
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), GateRelay)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        summary = traces.make_traces(remote(url, **{"traces.concurrency": 4, "traces.score_during_decoding": "false"}),
                                     out, **QUIET)
    finally:
        httpd.shutdown()
    done = [p.stat().st_mtime_ns for p in (out / "completions").glob("prompt-*.json")]
    parts = [p.stat().st_mtime_ns for p in (out / "parts").glob("prompts-*.json")]
    assert len(done) == 8 and len(parts) == 2 and max(done) < min(parts)
    assert summary["num_traces"] == 8 and load_traces(out)["prompt_index"] == list(range(8))
    assert summary["seconds_this_run"] >= 8  # the stage's clock covers the decoding (the relay held it for 8 s)
    assert traces.make_traces(remote(server.url), out, **QUIET)["requests_this_run"] == 0  # not part of the data's key


def test_a_killed_server_fails_clearly_and_a_rerun_completes_without_duplicates(tmp_path):
    s = Server(free_port(), tmp_path / "server.log").start()
    out = tmp_path / "srv"
    r = remote(s.url, **{"traces.num_prompts": 16, "traces.concurrency": 2, "traces.max_retries": 1})
    done = out / "completions"

    def kill_halfway():
        while len(list(done.glob("prompt-*.json"))) < 6 and s.proc.poll() is None:
            time.sleep(0.02)
        s.kill()

    killer = threading.Thread(target=kill_halfway)
    killer.start()
    try:
        with pytest.raises(ServerError, match=re.escape(s.url)):
            traces.make_traces(r, out, **QUIET)
    finally:
        killer.join()
    on_disk = {p.name for p in done.glob("prompt-*.json")}
    assert 6 <= len(on_disk) < 16 and not (out / "dataset").exists()
    s.start()
    try:
        summary = traces.make_traces(r, out, **QUIET)
    finally:
        s.kill()
    assert summary["requests_this_run"] == 16 - len(on_disk)  # only the prompts without a result were sent
    ds = load_traces(out)
    assert ds["prompt_index"] == list(range(16))
    traces.make_traces(recipe(**{"traces.num_prompts": 16}), tmp_path / "hf", **QUIET)
    assert ds["input_ids"] == load_traces(tmp_path / "hf")["input_ids"]


def test_an_unreachable_server_is_named_in_the_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ServerError, match=rf"{re.escape(url)}.*is it running"):
        traces.make_traces(remote(url, **{"traces.max_retries": 0}), tmp_path / "srv", **QUIET)
    assert not list((tmp_path / "srv").glob("parts/*.json"))


def test_a_model_the_server_does_not_serve_lists_the_ones_it_does(server, tmp_path):
    with pytest.raises(ServerError, match=rf"does not serve 'other/model'; it serves: '{re.escape(TEACHER)}'"):
        traces.make_traces(remote(server.url, **{"traces.server_model": "other/model"}), tmp_path / "srv", **QUIET)


class Answers(JsonHandler):
    """A server that answers /v1/models, and /v1/completions with the status and body set on the class."""

    status, body, calls = 200, {}, []

    def do_GET(self):
        self._send(200, {"data": [{"id": TEACHER}]})

    def do_POST(self):
        type(self).calls.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self._send(type(self).status, type(self).body)

    def _send(self, status, body):
        self.reply(status, json.dumps(body).encode())


@pytest.fixture
def answers():
    Answers.calls = []
    httpd = HTTPServer(("127.0.0.1", 0), Answers)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield Answers, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_a_response_without_text_is_an_error_naming_the_prompt(answers, tmp_path):
    cls, url = answers
    cls.status, cls.body = 200, {"choices": [{"finish_reason": "stop"}]}
    with pytest.raises(ServerError, match="prompt 0: the server's response has neither text nor token ids"):
        traces.make_traces(remote(url), tmp_path / "srv", **QUIET)
    # the probe took the openai style: token ids, greedy, the recipe's length
    assert cls.calls[0]["prompt"][:3] == [1, 3, 5] and cls.calls[0]["temperature"] == 0.0
    assert cls.calls[1]["max_tokens"] == 100 and cls.calls[1]["return_token_ids"] is True


def test_http_errors_are_retried_then_reported(answers):
    cls, url = answers
    cls.status, cls.body = 503, {"error": "overloaded"}
    naps = []
    client = ServerClient(url, max_retries=3, sleep=naps.append)
    with pytest.raises(ServerError, match=r"did not answer POST /completions after 4 attempts \(last error: HTTP 503"):
        client.complete({"prompt": "x"})
    assert len(cls.calls) == 4 and len(naps) == 3 and naps[0] < naps[1] < naps[2]  # backoff grows
    cls.status = 400
    cls.calls.clear()
    with pytest.raises(ServerError, match="HTTP 400"):
        client.complete({"prompt": "x"})
    assert len(cls.calls) == 1  # a rejected request is not retried


def test_sampling_settings_and_seeds_are_mapped_onto_the_request(answers, tmp_path):
    cls, url = answers
    cls.status, cls.body = 200, {"choices": [{"token_ids": [7] * 100, "finish_reason": "length"}]}
    r = remote(url, **{"traces.do_sample": True, "traces.temperature": 0.7, "traces.top_p": 0.9, "traces.top_k": 20,
                       "traces.seed": 3})
    traces.make_traces(r, tmp_path / "srv", **QUIET)
    sent = sorted(cls.calls[1:], key=lambda c: c["seed"])
    assert len(sent) == 8 and len({c["seed"] for c in sent}) == 8  # one request and one seed per prompt
    assert all((c["temperature"], c["top_p"], c["top_k"]) == (0.7, 0.9, 20) for c in sent)
    assert load_traces(tmp_path / "srv")["num_new_tokens"] == [100] * 8
    assert os.environ.get("NO_SUCH_KEY") is None
    with pytest.raises(ServerError, match=r"\$NO_SUCH_KEY, which is not set"):
        traces.make_traces(remote(url, **{"traces.api_key_env": "NO_SUCH_KEY"}), tmp_path / "k", **QUIET)
