"""The CUDA KV budget of a worker (worker/build.py), on hand-computed memory facts: its share
is per worker, as vLLM's gpu_memory_utilization, so two workers sharing a GPU each get theirs."""
import pytest

from pdserve.worker.build import cuda_kv_budget_bytes

GiB = 1 << 30


def test_alone_on_the_gpu():
    # 100 GiB GPU, this worker's weights 4 GiB: 0.9 * 100 - 4 - 2 (activation reserve) = 84
    assert cuda_kv_budget_bytes(0.9, free=95 * GiB, total=100 * GiB, own=4 * GiB) == 84 * GiB


def test_second_worker_on_a_shared_gpu_gets_its_own_share():
    # the first worker took 40 GiB (0.4 of the GPU); the second, 4 GiB of weights loaded, asks
    # for 0.4 too: 40 - 4 - 2 = 34 GiB, which the 55 GiB still free can hold
    assert cuda_kv_budget_bytes(0.4, free=55 * GiB, total=100 * GiB, own=4 * GiB) == 34 * GiB


def test_bounded_by_what_is_free():
    # others hold 80 GiB: only 16 - 2 = 14 GiB of the 0.9 share can be had
    assert cuda_kv_budget_bytes(0.9, free=16 * GiB, total=100 * GiB, own=4 * GiB) == 14 * GiB


@pytest.mark.parametrize("free, own", [(1 * GiB, 4 * GiB), (50 * GiB, 40 * GiB)])
def test_never_negative(free, own):
    assert cuda_kv_budget_bytes(0.4, free=free, total=100 * GiB, own=own) == 0
