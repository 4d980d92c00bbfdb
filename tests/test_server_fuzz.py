"""A property-based fuzz of the HTTP schema on a collocated and a 1P1D server (real worker
processes; a two-layer dummy model with SmolLM2's real tokenizer): a valid request with one
field (top-level, or inside a chat message or a content part) replaced by a hostile value —
lone surrogates, wrong JSON types, huge and negative numbers, NaN, nested junk. No answer may
be a 5xx, every 4xx carries the OpenAI error body, and a normal request succeeds after every
case (the engine survived it)."""
import json
import os

import pytest

httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from .test_server import _start, _stop, _stopped_cleanly  # noqa: E402
from .utils import assert_processes_gone, save_tiny_model_with_tokenizer  # noqa: E402

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "10"))  # CI budget; deeper: set it

# surrogates (category Cs) are what hypothesis' text() leaves out by default
_ugly_text = st.text(st.characters(categories=("Cs", "Lu", "Nd", "Zs", "Cc", "So")),
                     max_size=12)
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3),
    st.sampled_from([2 ** 63, -2 ** 63 - 1, 2 ** 64, 10 ** 30, 2 ** 63 - 1]),
    st.floats(allow_nan=True, allow_infinity=True), _ugly_text,
    st.lists(st.one_of(st.integers(-2, 2 ** 64), st.booleans(), _ugly_text, st.none()),
             max_size=4),
    st.dictionaries(_ugly_text, st.one_of(st.integers(), _ugly_text, st.none()), max_size=3),
)

BASE = {
    "/v1/completions": {"prompt": "Once upon", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "max_tokens": 2},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n",
                        "stop", "stop_token_ids", "seed", "logprobs", "echo", "stream",
                        "stream_options", "ignore_eos", "min_tokens", "presence_penalty",
                        "frequency_penalty", "repetition_penalty", "skip_special_tokens",
                        "model", "best_of", "suffix", "logit_bias", "response_format", "user"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "logprobs",
                             "top_logprobs", "stream", "n", "stop", "seed", "temperature",
                             "add_generation_prompt", "tools", "tool_choice",
                             "response_format", "model", "msg.role", "msg.content", "msg.name",
                             "part.type", "part.text", "part.image_url"],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "model"],
    "/detokenize": ["tokens", "model"],
}
CASES = [(path, f) for path, fs in FIELDS.items() for f in fs]


def _mutated(path: str, field: str, value) -> dict:
    body = json.loads(json.dumps(BASE[path]))
    if field.startswith("msg."):
        body["messages"][0][field[4:]] = value
    elif field.startswith("part."):
        body["messages"][0]["content"][0][field[5:]] = value
    else:
        body[field] = value
    # a value the server accepts must still make a short request (the generation caps)
    for key in ("max_tokens", "max_completion_tokens", "min_tokens", "n"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 4 < v < 2 ** 63:
            body[key] = 4
    return body


def _check(base: str, path: str, body: dict) -> None:
    raw = json.dumps(body)   # NaN becomes bare NaN (not JSON), a surrogate its \\u escape
    r = httpx.post(base + path, content=raw.encode(), timeout=120,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, raw, r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        assert err["code"] == r.status_code
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    ok = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200, f"after {path} {raw}: {ok.text}"


@pytest.fixture(scope="module", params=["collocated", "1p1d"])
def server(request, tmp_path_factory):
    model = save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny") / "model")
    extra = ["--prefill", "1", "--decode", "1"] if request.param == "1p1d" else []
    proc, base = _start(["--model", model, "--load-format", "dummy", "--max-model-len", "256",
                         "--num-kv-blocks", "256", "--max-num-seqs", "16", *extra])
    pids = httpx.get(base + "/admin/check").json()["worker_pids"]
    yield base
    try:
        state = httpx.get(base + "/admin/check", timeout=30).json()
        assert state["num_kv_blocks_used"] == 0 and state["num_running"] == 0, state
        assert httpx.get(base + "/health").json()["status"] == "ok"
    finally:
        assert _stopped_cleanly(_stop(proc))
        assert_processes_gone(pids)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(FIELDS))
def test_hostile_field_values(server, path):
    @settings(max_examples=EXAMPLES * len(FIELDS[path]) // 4, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(field=st.sampled_from(FIELDS[path]), value=HOSTILE)
    def fuzz(field, value):
        _check(server, path, _mutated(path, field, value))

    fuzz()
