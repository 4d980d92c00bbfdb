"""`pdserve serve` against third-party clients:

* schemathesis generates requests (valid and invalid) from the server's own /openapi.json for the
  public endpoints: none may answer 5xx, and every 4xx must carry the OpenAI error body (on a
  server with SmolLM2's tokenizer and a two-layer dummy model: only codes and bodies count);
* lm-eval's `local-completions` model (on the embedded SmolLM2, which knows the answers) runs
  a multiple-choice (loglikelihood, through echo + logprobs) and a generate_until task, both
  over local JSONL files, with its remote tokenizer (the server's /tokenize, /detokenize and
  /tokenizer_info; no HF hub).

Each test is skipped when its package is not installed."""
import json
import os

import pytest

from .test_server import MODEL, _metric

httpx = pytest.importorskip("httpx")

OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/health"),
              ("GET", "/tokenizer_info")]
# per operation and kind of data (schema-valid, invalid, made acceptable); raise for a longer hunt
MAX_EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "10"))  # CI budget; deeper: set it


@pytest.fixture(scope="module")
def server(small_server):
    return small_server   # (conftest.py: one server for this module and the request-schema tests)


# ---- schemathesis ------------------------------------------------------------------------------
# Generated requests may ask for up to max_model_len tokens, n up to 128, and chat without
# max_tokens runs to max_model_len: on 2 CPU cores (~15 tokens/s) that is up to minutes a
# request. Values the server accepts are lowered to these caps (values it must reject are sent
# unchanged), so every code path is still hit while each request stays short.
_CAPS = {"max_tokens": (4, 2 ** 63 - 1), "max_completion_tokens": (4, 2 ** 63 - 1),
         "min_tokens": (4, 2 ** 63 - 1), "n": (2, 128)}


def _bounded(case) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    for key, (cap, accepted) in _CAPS.items():
        v = body.get(key)  # integral floats (5053.0) pass as ints
        if isinstance(v, (int, float)) and not isinstance(v, bool) and cap < v <= accepted:
            body[key] = cap
    # not the defaults: 16 (completions), up to max_model_len (chat, where 0 means unset)
    path = case.operation.path
    if (path == "/v1/completions" and "max_tokens" not in body) or (
            path == "/v1/chat/completions" and body.get("max_tokens") is None
            and not body.get("max_completion_tokens")):
        body["max_tokens"] = 4


VOCAB = 49152  # SmolLM2's
_RANGES = {"temperature": (0, 2, 1.0), "top_p": (1e-3, 1, 1.0), "min_p": (0, 1, 0.0),
           "top_k": (1, 10 ** 6, None), "presence_penalty": (-2, 2, 0.0),
           "frequency_penalty": (-2, 2, 0.0), "repetition_penalty": (0.5, 2, 1.0),
           "min_tokens": (0, 4, 0), "top_logprobs": (0, 5, None)}


def _token(t):
    return int(t) % VOCAB  # ints may come as integral floats (1e18)


def _plausible(case):
    """The schema says little about ranges (temperature >= 0, token ids < vocab, ...), so most
    schema-valid bodies are 400s. This pulls one into what the server accepts, so that the engine
    paths (n, stream, echo, logprobs, stop, penalties, seeds, token-id prompts) get exercised."""
    b = case.body
    if not isinstance(b, dict):
        return case
    for key in ("model", "suffix", "best_of"):
        b.pop(key, None)
    for key, (lo, hi, default) in _RANGES.items():
        v = b.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not lo <= v <= hi:
            b[key] = default  # NaN lands here too
    if isinstance(b.get("logprobs"), int) and not isinstance(b["logprobs"], bool):
        b["logprobs"] = min(abs(b["logprobs"]), 5)
    if b.get("top_logprobs") is not None:
        b["logprobs"] = True
    for key in ("tokens", "stop_token_ids"):
        if isinstance(b.get(key), list):
            b[key] = [_token(t) for t in b[key]]
    if isinstance(b.get("stop"), (str, list)):
        b["stop"] = [x for x in ([b["stop"]] if isinstance(b["stop"], str) else b["stop"]) if x]
    p = b.get("prompt")
    if "prompt" in b and not p:
        b["prompt"] = "Hi"
    elif isinstance(p, list):  # of strings, of token ids or of token-id lists

        def fix(x):
            if isinstance(x, str):
                return x or "Hi"
            return [_token(t) for t in x] or [1] if isinstance(x, list) else _token(x)

        b["prompt"] = [fix(x) for x in p]
    for m in b.get("messages") or []:
        if isinstance(m, dict) and not m.get("role"):
            m["role"] = "user"
    if case.operation.path == "/tokenize" and ("prompt" in b) == ("messages" in b):
        b.pop("messages", None)
        b["prompt"] = b.get("prompt") or "Hi"
    return case


def openai_error_shape(ctx, response, case):
    """A schemathesis check: every 4xx is {"error": {"message", "type", "param", "code"}}."""
    if not 400 <= response.status_code < 500:
        return None
    body = response.json()
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, \
        f"not an OpenAI error body: {body!r}"
    assert isinstance(err["message"], str) and err["message"], body
    assert err["type"] in ("invalid_request_error", "not_found_error", "server_error"), body
    assert err["code"] == response.status_code, body
    assert err["param"] is None or isinstance(err["param"], str), body
    return None


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """For schemathesis: a server like small_server (one worker, 16 sequences, max_model_len
    256, SmolLM2's real tokenizer and chat template, so the same vocabulary and the same
    request paths) on a two-layer dummy-weight model. Generated requests check status codes and
    error bodies, never the text, and each costs milliseconds instead of the embedded model's
    seconds. At the end it must still be healthy and stop cleanly with no worker left."""
    from .conftest import served
    from .utils import save_tiny_model_with_tokenizer
    model = save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny") / "model")
    yield from served(["--model", model, "--load-format", "dummy", "--max-num-seqs", "16",
                       "--max-model-len", "256"])


@pytest.fixture(scope="module")
def api_schema(request):
    schemathesis = pytest.importorskip("schemathesis")  # before starting a server for nothing
    server = request.getfixturevalue("tiny_server")
    return schemathesis.openapi.from_url(server + "/openapi.json", timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("method, path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_schemathesis_no_server_errors(api_schema, method, path):
    """Schemathesis' valid and invalid requests for one operation, checked by its
    not_a_server_error and by openai_error_shape."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    op = api_schema[path][method]
    strategies = [op.as_strategy(schemathesis.GenerationMode.POSITIVE)]
    if method == "POST":  # a body to get wrong, or to make acceptable (the GETs take nothing)
        strategies += [op.as_strategy(schemathesis.GenerationMode.NEGATIVE),
                       op.as_strategy(schemathesis.GenerationMode.POSITIVE).map(_plausible)]
    checks = [schemathesis.checks.not_a_server_error, openai_error_shape]
    seen = []

    @settings(max_examples=MAX_EXAMPLES * len(strategies), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(*strategies))
    def fuzz(case):
        _bounded(case)
        seen.append(case.call_and_validate(timeout=120, checks=checks).status_code)

    fuzz()
    assert seen and all(code < 500 for code in seen)


# ---- lm-eval -----------------------------------------------------------------------------------
CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"),
            ("Spain", "Madrid")]
DISTRACTORS = ["banana", "bicycle", "purple", "seven", "umbrella"]

# Both tasks read a local JSONL file ({data}) and keep the datasets cache in tmp_path ({cache}).
_TASK_HEAD = """\
task: pdserve_capitals_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
  cache_dir: {{cache}}
test_split: test
"""

MC_TASK = _TASK_HEAD.format(kind="mc") + """\
output_type: multiple_choice
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = _TASK_HEAD.format(kind="gen") + """\
output_type: generate_until
doc_to_text: "Q: What is the capital of {{{{country}}}}?\\nA: The capital of {{{{country}}}} is"
doc_to_target: "{{{{capital}}}}"
generation_kwargs:
  until: [".", "\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "^\\\\s*(\\\\w+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def _write_tasks(root):
    mc = [{"country": c, "choices": [DISTRACTORS[i], cap], "label": 1}
          for i, (c, cap) in enumerate(CAPITALS)]
    gen = [{"country": c, "capital": cap} for c, cap in CAPITALS]
    for name, rows, task in (("mc", mc, MC_TASK), ("gen", gen, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(task.format(data=data, cache=root / "hf-datasets"))


@pytest.mark.slow
def test_lm_eval_local_completions(request, tmp_path, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")  # no hub here; local JSONL and the remote tokenizer only
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    server = request.getfixturevalue("server")
    _write_tasks(tmp_path)  # the datasets cache goes to tmp_path too (cache_dir)
    prompt_tokens = _metric(server, "pdserve:prompt_tokens_total")
    finished = _metric(server, "pdserve:request_success_total")

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": server + "/v1/completions", "model": MODEL,
                    "tokenizer_backend": "remote", "tokenized_requests": True,
                    "max_length": 256, "num_concurrent": 1, "max_retries": 1, "timeout": 120},
        tasks=["pdserve_capitals_mc", "pdserve_capitals_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        limit=len(CAPITALS), log_samples=True, bootstrap_iters=0)

    res = results["results"]
    acc = res["pdserve_capitals_mc"]["acc,none"]
    em = res["pdserve_capitals_gen"]["exact_match,first_word"]
    assert 0.0 <= acc <= 1.0 and 0.0 <= em <= 1.0, res
    # one capital against a random word: the model knows these
    assert acc == 1.0, res
    answers = [s["filtered_resps"] for s in results["samples"]["pdserve_capitals_gen"]]
    assert em >= 0.6, (res, answers)
    # the loglikelihoods came from the server's echo+logprobs scoring of each (context, choice)
    mc_samples = results["samples"]["pdserve_capitals_mc"]
    assert len(mc_samples) == len(CAPITALS)
    for s in mc_samples:
        lls = [r[0] for r in s["filtered_resps"]]
        assert all(ll < 0 for ll in lls) and lls[1] > lls[0], s["filtered_resps"]
    # ... and agree with scoring the same text directly (max_tokens 0 + echo: the prompt only)
    context = "The capital of France is"
    n_ctx = httpx.post(server + "/tokenize", json={"prompt": context}).json()["count"]
    direct = httpx.post(server + "/v1/completions", json={
        "model": MODEL, "prompt": context + " Paris", "max_tokens": 0, "echo": True,
        "logprobs": 1, "temperature": 0}, timeout=60).json()
    paris = sum(direct["choices"][0]["logprobs"]["token_logprobs"][n_ctx:])
    france = next(s for s in mc_samples if s["doc"]["country"] == "France")
    assert france["filtered_resps"][1][0] == pytest.approx(paris, abs=1e-2)
    # 5 docs x 2 choices scored + 5 generations, each one request (batch size 1)
    assert _metric(server, "pdserve:request_success_total") >= finished + 3 * len(CAPITALS)
    assert _metric(server, "pdserve:prompt_tokens_total") > prompt_tokens
    assert httpx.get(server + "/health").status_code == 200

