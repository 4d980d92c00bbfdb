"""The shared command-line arguments (pdserve/args.py) and the deployment factory's choices."""
import argparse

import pytest

from pdserve.args import (DeploymentArgs, add_deployment_args, add_engine_args, deployment_args,
                          engine_config)

# The flags `pdserve serve` took before the args module existed (cli.py at e6869e6): none may
# disappear or change its name.
OLD_SERVE_FLAGS = """--model --load-format --dtype --device --seed --block-size --max-num-seqs
--max-num-batched-tokens --max-model-len --num-kv-blocks --kv-cache-memory-gb
--gpu-memory-utilization --attention-backend --enforce-eager --skip-tokenizer-init
--tensor-parallel-size -tp --disable-custom-all-reduce --distributed-executor-backend --prefill
--decode --collocated --prefill-tp --decode-tp --collocated-tp --routing-policy --kv-connector
--kv-transfer-mode --kv-transfer-timeout --worker-restarts --restart-backoff --host --port
--served-model-name --log-level --shutdown-timeout --max-queued-requests --max-request-bytes
--keepalive --tokenizer-threads""".split()


def _parser():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_deployment_args(p)
    return p


def test_serve_keeps_every_flag(capsys):
    from pdserve.server.main import main
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    missing = [f for f in OLD_SERVE_FLAGS if f + " " not in shown and f + "," not in shown
               and f + "\n" not in shown]
    assert not missing, missing


def test_engine_config_takes_the_flags():
    a = _parser().parse_args(["--max-num-seqs", "7", "--block-size", "32", "--kv-transfer-timeout",
                              "5", "--kv-transfer-mode", "sync", "-tp", "2", "--enforce-eager",
                              "--kv-connector", "relay"])
    c = engine_config(a)
    assert (c.max_num_seqs, c.block_size, c.kv_transfer_timeout_s, c.kv_transfer_mode,
            c.tensor_parallel_size, c.enforce_eager) == (7, 32, 5.0, "sync", 2, True)
    assert c.kv_connector is None  # a deployment choice, for its prefill and decode workers
    d = deployment_args(a)
    assert d.kv_connector == "relay" and d.worker_restarts == 3 and d.restart_backoff_s == 1.0


def test_defaults_match_engine_config():
    from pdserve.config import EngineConfig
    assert engine_config(_parser().parse_args([])) == EngineConfig()


def test_async_scheduling_flag():
    assert engine_config(_parser().parse_args([])).async_scheduling is True
    assert engine_config(_parser().parse_args(["--no-async-scheduling"])).async_scheduling is False


@pytest.mark.parametrize("kwargs, counts, policy", [
    ({}, (0, 0, 1), "collocated"),                       # nothing asked: one collocated worker
    ({"prefill": 1, "decode": 2}, (1, 2, 0), "disagg"),
    ({"collocated": 2}, (0, 0, 2), "collocated"),
    ({"prefill": 1, "decode": 1, "collocated": 1, "routing_policy": "round-robin"}, (1, 1, 1),
     "round-robin"),
])
def test_deployment_defaults(kwargs, counts, policy):
    d = DeploymentArgs(**kwargs)
    assert d.counts == counts and d.policy == policy


@pytest.mark.parametrize("flags, message", [
    (["--routing-policy", "fastest"], "invalid choice"),
    (["--attention-backend", "flash"], "invalid choice"),
    (["--dtype", "int3"], "invalid choice"),
])
def test_bad_choices_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(flags)
    assert message in capsys.readouterr().err


def test_build_rejects_an_unpaired_deployment():
    from pdserve.config import EngineConfig
    from pdserve.deploy import build
    with pytest.raises(ValueError, match="come together"):
        build(EngineConfig(), DeploymentArgs(prefill=1))


def test_engine_argv_gives_the_config_back_through_serves_parser():
    """engine_argv's flags, parsed by `pdserve serve`'s own parser, make the same EngineConfig
    (every kind of flag: values, store_true, --no-..., BooleanOptionalAction both ways); the
    default config needs no flag; a field no flag sets is refused by name."""
    from pdserve.args import engine_argv
    from pdserve.config import EngineConfig
    from pdserve.server.main import parse_args
    cfg = EngineConfig(model="/m", load_format="dummy", dtype="float16", seed=3, block_size=32,
                       max_num_seqs=9, max_num_batched_tokens=128, max_model_len=300,
                       kv_cache_memory_gb=0.5, gpu_memory_utilization=0.8, enforce_eager=True,
                       cuda_graph_max_tokens=0, async_scheduling=False,
                       enable_prefix_caching=False, skip_tokenizer_init=True)
    argv = engine_argv(cfg)
    assert "--no-async-scheduling" in argv and "--no-enable-prefix-caching" in argv
    assert engine_config(parse_args(argv)) == cfg
    assert engine_argv(EngineConfig()) == []
    with pytest.raises(ValueError, match="cuda_graph_max_batch=64 has no command-line flag"):
        engine_argv(EngineConfig(cuda_graph_max_batch=64))
