"""Test helpers: run the engine's model over a token sequence through the paged KV cache."""
from __future__ import annotations

import contextlib
import gc
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import torch

from pdserve.engine.scheduler import ScheduledChunk


@torch.inference_mode()
def paged_logits(engine, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits [len(ids), V] for every position, computed in prefill chunks of `chunk` tokens that
    attend to the cached context of the previous chunks (None: one chunk)."""
    kv, runner, model = engine.kv, engine.runner, engine.model
    rid = "__probe__"
    chunk = chunk or len(ids)
    out = []
    try:
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            assert kv.allocate_slots(rid, start, len(piece)) is not None
            c = ScheduledChunk(rid, piece, start, list(kv.block_tables[rid]), True)
            hidden, _ = runner._forward([c])
            out.append(model.compute_logits(hidden))
    finally:
        kv.free(rid)
    return torch.cat(out)


def save_tiny_hf_model(path, kind: str = "qwen2", seed: int = 0, **overrides):
    """A small random HF model saved as safetensors: Qwen2 (QKV bias, untied), Llama (tied),
    Mistral (untied) or Qwen3 (q/k norms, tied, head_dim 32); `overrides` go to the transformers
    config class. Returns the transformers model (eval, fp32)."""
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=0, bos_token_id=1)
    per_kind = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                          dict(rope_theta=1e6, tie_word_embeddings=False)),
                "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                          dict(rope_theta=5e5, tie_word_embeddings=True, head_dim=16)),
                "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                            dict(rope_theta=1e4, tie_word_embeddings=False, head_dim=16)),
                # head_dim 32 is not hidden / heads (8): a config read as Qwen2 would not load
                "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                          dict(rope_theta=1e6, tie_word_embeddings=True, head_dim=32))}
    config_cls, model_cls, extra = per_kind[kind]
    model = model_cls(config_cls(**{**common, **extra, **overrides}))
    with torch.no_grad():  # biases are zero and norms one at init: make them count
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path)
    return model


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def assert_processes_gone(pids, timeout_s: float = 15.0) -> None:
    """Every pid has exited within timeout_s (worker processes after a stop or a failure)."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while _running(pid):
            assert time.monotonic() < deadline, f"worker pid {pid} still running"
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], timeout_s: float = 180.0):
    """`pdserve serve --port <free> *args` as a process, once /health answers: (proc, base URL).
    The server's stderr goes to proc.log (a file, not a pipe: a pipe nobody reads fills up with
    the server's log and then blocks the server, a hang that is the test's, not the server's)."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited: {log.read()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not come up")


def stopped_cleanly(code: int) -> bool:
    # uvicorn drains, then re-raises the SIGTERM it caught: the conventional "killed by TERM"
    return code in (0, -signal.SIGTERM)


def stop_server(proc) -> int:
    """SIGTERM, then the exit code (killed if it takes over 60 s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    finally:
        proc.kill()


def run_compiled(script: str) -> None:
    """Runs `script` in a fresh interpreter with Triton's interpreter off (it may compile
    kernels for a GPU target without a GPU) from the repo root; it must print "compiled-ok"."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert res.returncode == 0 and "compiled-ok" in res.stdout, res.stderr[-4000:]


def save_tiny_model_with_tokenizer(path) -> str:
    """A folder the server starts from in seconds: a two-layer Llama config for dummy weights
    (load_format="dummy") with the embedded SmolLM2's real tokenizer and chat template, so
    text prompts, chat and tokenization behave as with the real model."""
    import json
    import os

    from pdserve.loader.model_loader import load_tokenizer, resolve_source
    tok = load_tokenizer(resolve_source(None))
    os.makedirs(path, exist_ok=True)
    tok.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": tok.bos_token, "eos_token": tok.eos_token,
                   "chat_template": tok.chat_template}, f)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": tok.vocab_size,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
           "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


@contextlib.contextmanager
def frozen_heap():
    """For in-process runs of a command that collects garbage before each row it measures
    (pdserve profile, bench step, bench prefix): the objects the test session holds already
    (models, tensors and modules of the tests before: seconds of scanning per collection late
    in a whole-suite run) are set aside meanwhile, gc.freeze's permanent generation, and handed
    back to the collector after. What the command creates is collected as without it."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def metric_value(text: str, query: str) -> float:
    """The sum of the Prometheus samples in `text` (the exposition format) named as `query`
    says, with at least its labels: 'pdserve:kv_transfers_total' or
    'pdserve:requests_by_path_total{path="disagg"}' (whatever other labels, e.g. model_name,
    a sample has)."""
    import re
    name, _, want = query.partition("{")
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', want))
    total = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        sname, _, labels = series.partition("{")
        if sname == name and wanted.items() <= dict(re.findall(r'(\w+)="([^"]*)"', labels)).items():
            total += float(value)
    return total
