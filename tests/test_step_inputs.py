"""The step buffers every forward reads (pdserve/worker/step_inputs.py) and the CUDA-graph
dispatcher's choice of graph (CUDAGraphRunner.plan), on CPU: the layout is checked against a
batch worked out by hand, and the plans against the bucket rules written in the module doc."""
import torch

from pdserve.engine.scheduler import ScheduledChunk
from pdserve.worker.cuda_graph import CUDAGraphRunner, context_tiers, mixed_sizes
from pdserve.worker.step_inputs import StepInputs

BS = 4          # block size
SCRATCH = 9     # scratch block id


def _inputs(max_tokens=32, max_seqs=6, max_blocks=5):
    return StepInputs(max_tokens, max_seqs, max_blocks, SCRATCH, BS, torch.device("cpu"))


def test_mixed_batch_layout_with_padding():
    x = _inputs()
    chunks = [ScheduledChunk("d0", [11], 6, [3, 7], True),           # decode at position 6
              ScheduledChunk("d1", [12], 0, [5], True),              # decode at position 0
              ScheduledChunk("p", [21, 22, 23, 24, 25], 3, [2, 8], False)]  # positions 3..7
    staged = x.stage(chunks, t_pad=10, b_pad=5)
    assert (staged.num_tokens, staged.num_seqs) == (7, 3)
    assert staged.query_start_loc == [0, 1, 2, 7]
    assert staged.seq_lens == [7, 1, 8]
    assert (staged.max_query_len, staged.max_seq_len) == (5, 8)
    # by hand: slot = table[pos // 4] * 4 + pos % 4; padding writes the scratch block's slot 0
    assert x.input_ids[:10].tolist() == [11, 12, 21, 22, 23, 24, 25, 0, 0, 0]
    assert x.positions[:10].tolist() == [6, 0, 3, 4, 5, 6, 7, 0, 0, 0]
    assert x.slot_mapping[:10].tolist() == [7 * 4 + 2, 5 * 4, 2 * 4 + 3, 8 * 4, 8 * 4 + 1,
                                            8 * 4 + 2, 8 * 4 + 3, 36, 36, 36]
    # padding sequences: q_len 0 (start at T), seq_len 0
    assert x.query_start_loc[:6].tolist() == [0, 1, 2, 7, 7, 7]
    assert x.seq_lens[:5].tolist() == [7, 1, 8, 0, 0]
    assert x.block_tables[0, :2].tolist() == [3, 7]
    assert x.block_tables[2, :2].tolist() == [2, 8]


def test_restaging_a_smaller_batch_overwrites_what_it_reads():
    x = _inputs()
    x.stage([ScheduledChunk("p", list(range(1, 9)), 0, [1, 2], True)], t_pad=16, b_pad=4)
    staged = x.stage([ScheduledChunk("d", [5], 4, [6, 4], True)], t_pad=2, b_pad=2)
    assert staged.query_start_loc == [0, 1] and staged.seq_lens == [5]
    assert x.input_ids[:2].tolist() == [5, 0]
    assert x.slot_mapping[:2].tolist() == [4 * 4, SCRATCH * BS]
    assert x.query_start_loc[:3].tolist() == [0, 1, 1]
    assert x.seq_lens[:2].tolist() == [5, 0]


def test_a_batch_past_the_buffers_is_a_value_error():
    x = _inputs(max_tokens=16, max_seqs=2)
    import pytest
    with pytest.raises(ValueError, match="exceeds the step buffers"):
        x.stage([ScheduledChunk(f"r{i}", [1], 0, [0], True) for i in range(3)])
    with pytest.raises(ValueError, match="exceeds the step buffers"):
        x.stage([ScheduledChunk("r", [1] * 17, 0, [0] * 5, True)])


def test_mixed_sizes_end_at_the_budget():
    assert mixed_sizes(0) == []
    assert mixed_sizes(96) == [16, 32, 48, 64, 96]
    assert mixed_sizes(100) == [16, 32, 48, 64, 96, 100]
    assert mixed_sizes(2048)[-3:] == [1024, 1536, 2048]


def test_context_tiers():
    assert context_tiers(32768, 1) == [511, 32768]
    assert context_tiers(32768, 4) == [511, 2047, 8191, 32768]
    assert context_tiers(4096, 4) == [511, 2047, 4096]
    assert context_tiers(300, 4) == [300]


def test_plan_picks_the_smallest_graph_that_holds_the_step():
    x = _inputs(max_tokens=512, max_seqs=64, max_blocks=1024)
    g = CUDAGraphRunner(model=None, inputs=x, max_batch=16, max_mixed_tokens=256,
                        max_seq_len=4096)
    assert g.tiers == [511, 4096] and g.mixed_tiers == [511, 2047, 4096]
    # decode-only: the decode family, batch bucket and context tier
    p = g.plan(num_tokens=3, num_seqs=3, max_query_len=1, max_seq_len=100)
    assert (p.key, p.num_tokens, p.num_seqs) == (("decode", 511, 4), 4, 4)
    assert g.plan(9, 9, 1, 2000).key == ("decode", 4096, 16)
    # more decodes than the largest decode graph: a mixed graph holds them
    p = g.plan(40, 40, 1, 300)
    assert (p.key, p.num_tokens, p.num_seqs) == (("mixed", 511, 48), 48, 48)
    # prefill tokens: the token bucket; sequences padded to min(tokens, max_seqs)
    p = g.plan(num_tokens=33 + 200, num_seqs=34, max_query_len=200, max_seq_len=3000)
    assert (p.key, p.num_tokens, p.num_seqs) == (("mixed", 4096, 256), 256, 64)
    assert g.plan(17, 2, 16, 16).key == ("mixed", 511, 32)
    assert g.plan(17, 2, 16, 2000).key == ("mixed", 2047, 32)
    # past the largest bucket or the longest tier: eager
    assert g.plan(257, 1, 257, 257) is None
    assert g.plan(10, 1, 10, 5000) is None
