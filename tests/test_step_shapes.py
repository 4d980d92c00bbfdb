"""pdserve/step_shapes.py by hand: the buckets, the padding, and which configurations graph."""
import pytest

from pdserve.step_shapes import (MAX_GRAPH_TOKENS, graph_max_tokens, mixed_sizes, padded_tokens,
                                 uses_cuda_graphs)
from pdserve.worker import cuda_graph


def test_padded_tokens_is_the_smallest_bucket_that_holds_the_step():
    sizes = mixed_sizes(2048)
    assert padded_tokens(1, sizes) == 16
    assert padded_tokens(16, sizes) == 16
    assert padded_tokens(17, sizes) == 32
    assert padded_tokens(1025, sizes) == 1536
    assert padded_tokens(2048, sizes) == 2048
    assert padded_tokens(2049, sizes) == 2049       # past the largest: eager, its own count
    assert padded_tokens(300, []) == 300             # no graphs
    assert padded_tokens(100, mixed_sizes(100)) == 100 and padded_tokens(97, mixed_sizes(100)) == 100


def test_the_runner_captures_the_same_buckets():
    assert cuda_graph.mixed_sizes is mixed_sizes


@pytest.mark.parametrize("config,want", [
    ({}, 0),                                                          # CPU: no graphs
    ({"device": "cpu", "max_num_batched_tokens": 4096}, 0),
    ({"device": "cuda", "max_num_batched_tokens": 2048}, 2048),
    ({"device": "cuda:1", "max_num_batched_tokens": 8192}, 8192),
    ({"device": "cuda", "max_num_batched_tokens": 16384}, MAX_GRAPH_TOKENS),
    ({"device": "cuda", "max_num_batched_tokens": 8192, "cuda_graph_max_tokens": 512}, 512),
    ({"device": "cuda", "max_num_batched_tokens": 256, "cuda_graph_max_tokens": 512}, 256),
    ({"device": "cuda", "max_num_batched_tokens": 8192, "cuda_graph_max_tokens": 0}, 0),
    ({"device": "cuda", "max_num_batched_tokens": 8192, "enforce_eager": True}, 0),
    ({"device": "cuda", "max_num_batched_tokens": 8192, "attention_backend": "torch"}, 0),
    ({"device": "cuda", "max_num_batched_tokens": 8192, "attention_backend": "triton"}, 8192),
])
def test_graph_max_tokens_of_a_configuration(config, want):
    assert graph_max_tokens(config) == want
    assert uses_cuda_graphs(config) == (config.get("device", "").startswith("cuda")
                                        and not config.get("enforce_eager")
                                        and config.get("attention_backend") != "torch")


def test_an_engine_config_on_cpu_has_no_graphs():
    from pdserve.config import EngineConfig
    c = EngineConfig(max_num_batched_tokens=4096)
    assert not c.use_cuda_graphs and c.graph_max_tokens == 0
