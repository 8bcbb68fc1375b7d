"""Bad input, fuzzed: the bridge in front of the real servicer (simulated engine) never answers
500 and never crashes, whatever the body; malformed JSON, a wrong content type, a body over the
configured limit and bytes that are not UTF-8 get 4xx.

Hypothesis generates request bodies field by field (plausible values, boundary values, values of
the wrong JSON type, unknown fields) and whole arbitrary JSON documents. The backend is the real
`service.servicer.GenerateServicer` with its validation, detokenization and stop strings over a
`SimExecutor` engine (tests/service/harness.py), so an error that only the service finds is
fuzzed too. Each example goes through the bridge app over ASGI.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bridge.app import create_app
from tests.service.harness import running_server

MAX_BODY_BYTES = 64 * 1024


class _Rig:
    """A background event loop running the engine server and the bridge app (ASGI client)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._stop = asyncio.Event()
        self._ready = self.call(self._setup())

    async def _setup(self) -> None:
        self._cm = running_server(num_blocks=4096, step_s=0.0)
        srv = await self._cm.__aenter__()
        self.app = create_app(srv.target, max_body_bytes=MAX_BODY_BYTES)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://bridge",
                                        timeout=60)

    async def _teardown(self) -> None:
        await self.client.aclose()
        await self._lifespan.__aexit__(None, None, None)
        await self._cm.__aexit__(None, None, None)

    def call(self, coro, timeout_s: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def post(self, **kw) -> httpx.Response:
        return self.call(self.client.post("/v1/completions", **kw))

    def close(self) -> None:
        self.call(self._teardown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def rig():
    r = _Rig()
    yield r
    r.close()


def assert_not_a_server_error(resp: httpx.Response) -> None:
    assert resp.status_code < 500 or resp.status_code == 503, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert {"message", "type", "code"} <= set(error), error
        assert error["code"] != "internal", error
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert '"code":"internal"' not in resp.text, resp.text[-500:]
        assert resp.text.rstrip().endswith("data: [DONE]") or "event: error" in resp.text, resp.text[-500:]
    else:
        assert resp.json()["object"] == "text_completion"


json_scalar = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30))
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
small_ints = st.integers(min_value=-3, max_value=1100) | st.sampled_from([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**64])
token_ids = st.lists(st.integers(min_value=-2, max_value=50_000) | st.sampled_from([2**32 - 1, 2**32]), max_size=24)
FIELDS = {
    "prompt": st.text(max_size=120) | token_ids | st.lists(st.text(max_size=10), max_size=3) | json_value,
    "prompt_token_ids": token_ids | json_value,
    "max_tokens": st.integers(min_value=-3, max_value=40) | small_ints | json_value,
    "temperature": st.floats(min_value=-2, max_value=3, allow_nan=False) | json_value,
    "top_k": small_ints | json_value,
    "top_p": st.floats(min_value=-1, max_value=2, allow_nan=False) | json_value,
    "stop": st.lists(st.text(max_size=40), max_size=6) | st.text(max_size=5) | json_value,
    "seed": st.integers(min_value=-1, max_value=2**65) | json_value,
    "n": st.integers(min_value=-1, max_value=10) | json_value,
    "logprobs": st.integers(min_value=-1, max_value=8) | json_value,
    "stream": st.booleans() | json_value,
    "ignore_eos": st.booleans() | json_value,
    "deadline_s": st.floats(min_value=-1, max_value=1e4, allow_nan=False) | json_value,
    "model": st.text(max_size=20) | json_value,
}
# In range, so most of these run: stop strings, n, logprobs, seeds on the real servicer.
PLAUSIBLE = {
    "max_tokens": st.integers(min_value=1, max_value=30),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_k": st.integers(min_value=-1, max_value=100),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=4),
    "seed": st.integers(min_value=0, max_value=2**64 - 1),
    "n": st.integers(min_value=1, max_value=8),
    "logprobs": st.integers(min_value=0, max_value=5),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "deadline_s": st.floats(min_value=0.5, max_value=600),
}
bodies = (st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=60) | token_ids}, optional=PLAUSIBLE)
          | st.fixed_dictionaries({}, optional=FIELDS)
          | st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=40)},
                                  optional={k: v for k, v in FIELDS.items() if k != "prompt"})
          | st.dictionaries(st.text(max_size=12), json_value, max_size=5)
          | json_value)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_fuzzed_bodies_never_get_a_500(rig, body):
    resp = rig.post(json=body)
    event(f"HTTP {resp.status_code}")      # --hypothesis-show-statistics shows the mix
    assert_not_a_server_error(resp)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=300))
def test_fuzzed_raw_bytes_never_get_a_500(rig, raw):
    resp = rig.post(content=raw, headers={"content-type": "application/json"})
    assert_not_a_server_error(resp)
    assert resp.status_code != 200 or json.loads(raw)   # only a real JSON body can succeed


@pytest.mark.parametrize("content, headers, status", [
    (b'{"prompt": "hi", ', {"content-type": "application/json"}, 400),               # malformed JSON
    (b'{"prompt": "hi"}}', {"content-type": "application/json"}, 400),
    (b'', {"content-type": "application/json"}, 400),
    (b'{"prompt": NaN}', {"content-type": "application/json"}, 400),
    (b'{"prompt": "\xff\xfe caf\xe9"}', {"content-type": "application/json"}, 400),   # not UTF-8
    (b'\xff\xfe\x00{', {"content-type": "application/json"}, 400),
    (b'{"prompt": "hi"}', {"content-type": "text/plain"}, 415),                        # wrong type
    (b'prompt=hi', {"content-type": "application/x-www-form-urlencoded"}, 415),
    (b'{"prompt": "hi"}', {"content-type": "multipart/form-data; boundary=x"}, 415),
])
def test_malformed_bodies_and_wrong_content_types_are_4xx(rig, content, headers, status):
    resp = rig.post(content=content, headers=headers)
    assert resp.status_code == status, resp.text
    assert_not_a_server_error(resp)


def test_json_content_type_variants_and_no_content_type_are_accepted(rig):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for headers in ({"content-type": "application/json; charset=utf-8"},
                    {"content-type": "application/vnd.api+json"}, {}):
        resp = rig.post(content=body, headers=headers)
        assert resp.status_code == 200, (headers, resp.text)


def test_a_body_over_the_limit_is_413_whether_or_not_it_says_its_length(rig):
    big = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    resp = rig.post(content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "payload_too_large", resp.text

    async def chunks():                                   # chunked: no Content-Length
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]
    resp = rig.post(content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413, resp.text
    ok = rig.post(json={"prompt": "x" * (MAX_BODY_BYTES // 2), "max_tokens": 1})
    assert ok.status_code in (200, 400), ok.text           # under the limit: handled normally
