"""Paged attention (Triton) for a mixed batch of decode tokens and prefill chunks.

One call attends every query token of a flat batch over its sequence's cached context plus the
new tokens up to and including itself (causal), reading K/V through a block table. Grouped-query
attention reads each K/V head once for all G = H / Hkv query heads that share it, and split-K
("flash-decoding") cuts long key ranges into pieces so that a few long sequences still fill the GPU.
With a sliding window W (a host int, the same for the whole call: one model layer), the query at
position p sees only keys at positions > p - W.

Batch layout (decode rows usually first, but any order works)::

    q rows:           | d0 | d1 | p0 p0 p0 p0 p0 | p1 p1 |       | xx xx |     q: [T, H, D]
    query_start_loc:    0    1    2                7       9      9     (T)    [B + 1] int32
    seq_lens:           c0+1 c1+1 c2+5             c3+2    0 (pad seq)         [B] int32
    Query token j of sequence b sits at position ctx_b + j (ctx_b = seq_lens[b] - q_len_b) and
    attends key positions 0 .. ctx_b + j. A padding sequence (q_len 0) writes nothing and reads
    nothing. Rows xx past query_start_loc[B] belong to no sequence and are left UNTOUCHED.

Where key position p of sequence b lives::

    p --> logical block p // BS --> n = block_tables[b, p // BS] --> k_cache[n, p % BS, kv_head, :]
    (k_cache / v_cache: [NB, BS, Hkv, D], any strides with a contiguous last dim, e.g. kv[0], kv[1]
    of a [2, NB, BS, Hkv, D] tensor). Table entries past ceil(seq_len / BS) are never read.

One program's tile: BLOCK_M rows = (query token, grouped head) pairs of ONE kv head,
row r = (r // G)-th token of the tile, head kv_head * G + r % G::

                   key tiles of this split, BLOCK_N keys each, block ids gathered per key
                   | full tile | full tile | full tile | masked | masked |  (skipped)  ...
      r=0  tok0 h0 |                                            |        |
      r=1  tok0 h1 |  S = Q K^T * scale*log2e  (fp32)           |        |
      ...          |  m, l: online softmax (exp2)               |        |
      r=G  tok1 h0 |  acc += P V               (fp32)           |        |
      ...          |                                            |        |
    Tiles below the tile's first query position need no mask; tiles that reach its last query
    position get the causal mask; tiles wholly past it are never visited (causal skipping).
    With a window (SLIDING, a constexpr; W itself a runtime scalar) the key range starts at the
    first row's window edge instead of 0, tile-aligned down:

        keys:  0 ...... | masked: window edge | no mask     | masked: causal | (skipped)
                (never  ^kv_lo                ^full_lo      ^full_end        ^kv_hi
                 read)    = (p_first - W + 1)   = (p_last     = (p_first + 1)  = p_last + 1
                            rounded down          - W + 1)      rounded down
                                                  rounded up
    Rows pack tokens x heads (rather than one program per query head) so each K/V byte is read
    once per kv head for all G heads, for prefill as for decode, and one code path serves both.

Two launches of one stage-1 kernel, each sequence picked by exactly one of them by its q_len
(read on the device, never on the host)::

    decode  (q_len <= TPT_d = 16 // G tokens, DECODE_CONFIG):
        grid = (B, Hkv, S_d)           one program per (sequence, kv head, key split)
    prefill (q_len >  TPT_d, prefill_config_for; launched only when max_query_len > TPT_d):
        grid = (T // TPT_p + B, Hkv, S_p)   TPT_p = 64 // G query tokens per tile; grid row i
        belongs to the last sequence b with query_start_loc[b] // TPT_p + b <= i (binary search
        in the kernel): a static bound on sum_b ceil(q_len_b / TPT_p), from shapes only.

With S > 1 splits, each program writes its partial (m, l, acc) in fp32 and a reduce kernel (the
same grid without the split axis) combines them:
    M = max_s m_s,   out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
Split s of a tile covers keys [kv_lo + s*C, kv_lo + (s+1)*C), C = max(ceil(ceil((kv_hi - kv_lo) /
S) / BLOCK_N) * BLOCK_N, MIN_CHUNK) with [kv_lo, kv_hi) the tile's own key range (kv_lo = 0
without a window), so splits follow each sequence's real length, not max_seq_len: only the first
ceil((kv_hi - kv_lo) / C) splits hold keys, the others exit at once, and the reduce reads only
those. That matters under a CUDA graph, whose max_seq_len is the captured bound: a 1,300-token
decode under a 32k bound is launched with 64 splits, fills 21 of them and is reduced over 21,
not 64. A split also takes at least sqrt(CHUNK_SQRT * (kv_hi - kv_lo)) keys (tile-aligned;
config "chunk_sqrt", 16 for decode, 0 = off): a split's serial work grows with its chunk C and
the reduce's with the splits L / C, and a * C + b * L / C is least at C = sqrt(b / a * L). On an
H100 under the 32k bound (a946dca, batches 1-64) the best of chunk minima 64 / 128 / 256 / 512
was the one nearest sqrt(16 L) for 600, 4,000 and 16,000 keys: 27 vs 16.5 us a layer at 4,000
keys, batch 1. MIN_CHUNK (config "min_chunk") is one tile unless it says more (`python -m
pdserve.kernels.bench --splits` times the choices). S itself is chosen on the host from
max_seq_len (default_num_kv_splits): 1 for short bounds, growing until B * Hkv * S >= 4 *
num_SMs with max_seq_len / S >= 256; a sequence shorter than the bound gets smaller splits.

CUDA-graph safe: the launcher reads only shapes, strides and the host ints max_query_len /
max_seq_len (static upper bounds: they choose launches and split counts, never correctness).
"""
from __future__ import annotations

import functools
import math
import operator

import torch
import triton
import triton.language as tl

from ._interpreter import INTERPRET as _INTERPRET   # (importing it patches the interpreter)

__all__ = ["paged_attention", "paged_attention_ref", "default_num_kv_splits"]

_LOG2E = 1.4426950408889634
# finite "minus infinity" for running maxima: exp2(_NEG - x) == 0, and never inf - inf = NaN
_NEG = tl.constexpr(-1.0e30)

# Tuning knobs (H200 guesses, checked here only by compiling for sm_90 with the wheel's ptxas;
# pdserve/kernels/bench.py measures them on the device). "block_n": None means block_n_elems //
# D_PAD keys per tile, clamped to [16, 128].
# Decode: 16-row tiles (tl.dot needs >= 16 rows; G <= 8 heads x 1 token fill 6..8 of them),
#   64 keys at D=128; 3 stages keep two K/V tiles in flight (~70 KB smem, ~113-153 regs:
#   3 programs per SM).
# Prefill: 64-row tiles, 32 keys at D=128, 3 stages (~66 KB smem, ~176 regs: 2 programs per SM;
#   64-key tiles would need ~115 KB smem at 3 stages, i.e. 1 program per SM).
DECODE_CONFIG = {"block_m": 16, "block_n": None, "block_n_elems": 8192, "num_warps": 4,
                 "num_stages": 3, "chunk_sqrt": 16}
PREFILL_CONFIG = {"block_m": 64, "block_n": None, "block_n_elems": 4096, "num_warps": 4,
                  "num_stages": 3, "chunk_sqrt": 0}
# Wider key tiles for the query-tile launch (64 keys at D = 128: ~115 KB of smem at 3 stages, one
# program per SM) where an H100 measured them faster as mixed CUDA graphs run them (`python -m
# pdserve.kernels.bench --extend`, bench/RESULTS.md, twelfth session): steps whose longest chunk
# is >= 1,024 tokens (13-25% less time: long prompts) or <= 128 (3-18% less: a question after a
# cached prefix). Chunks of 256-512 tokens over cached context took 8-14% more with them. Half
# dtypes only (fp32 tiles of that width do not fit).
PREFILL_WIDE_CONFIG = {"block_n_elems": 8192}
PREFILL_WIDE_AT = (128, 1024)      # wide when max_query_len <= the first or >= the second
SPLIT_TARGET_PROGRAMS_PER_SM = 4   # decode: aim for B * Hkv * splits >= this * num SMs ...
MIN_KEYS_PER_SPLIT = 256           # ... with no split shorter than this many keys
MAX_SPLITS = 64
PREFILL_TARGET_PROGRAMS_PER_SM = 2
PREFILL_MIN_KEYS_PER_SPLIT = 1024
PREFILL_MAX_SPLITS = 16


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _locate_tile(pid_t, qsl_ptr, num_seqs, TPT: tl.constexpr, ONE_TILE_PER_SEQ: tl.constexpr):
    """(sequence, first query token of this tile, query start offset, q_len) of grid row pid_t."""
    if ONE_TILE_PER_SEQ:
        b = pid_t
        j0 = pid_t * 0
    else:
        # Tiles of sequence b start at qsl[b] // TPT + b: an increasing sequence whose gaps are
        # >= the sequence's tile count. Find the last b whose start is <= pid_t.
        lo = pid_t * 0
        hi = lo + num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start = tl.load(qsl_ptr + mid) // TPT + mid
            ok = start <= pid_t
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        b = lo
        j0 = (pid_t - (tl.load(qsl_ptr + b) // TPT + b)) * TPT
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    return b, j0, q_start, q_len


@triton.jit
def _load_block_ids(bt_row_ptr, start, hi, offs_n, stride_btn, BS: tl.constexpr):
    """Physical block id of each key position start + offs_n (0 past hi: never used as data)."""
    p = start + offs_n
    return tl.load(bt_row_ptr + (p // BS) * stride_btn, mask=p < hi, other=0)


@triton.jit
def _attend_tile(acc, l_i, m_i, q, qk_scale, start, hi, pos_row, window, blk, k_ptr, v_ptr,
                 stride_cb, stride_cs, kv_head_off, offs_n, offs_d,
                 BS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr,
                 SLIDING: tl.constexpr, DOT_PREC: tl.constexpr):
    """One BLOCK_N tile of keys [start, start + BLOCK_N) whose physical block ids (one per key)
    are blk: gather K/V, score, online-softmax update. MASKED tiles apply the causal mask and,
    when SLIDING, the window's lower edge (key p visible to row r iff p > pos_r - window)."""
    p = start + offs_n                                               # key positions  [BLOCK_N]
    if MASKED:
        in_range = p < hi
    kv_off = blk.to(tl.int64) * stride_cb + (p % BS) * stride_cs + kv_head_off   # [BLOCK_N]
    ptrs = kv_off[:, None] + offs_d[None, :]                          # [BLOCK_N, D_PAD]
    if MASKED:
        ld_mask = in_range[:, None] & (offs_d[None, :] < D)
        k = tl.load(k_ptr + ptrs, mask=ld_mask, other=0.0)
        v = tl.load(v_ptr + ptrs, mask=ld_mask, other=0.0)
    elif D_PAD != D:
        ld_mask = offs_d[None, :] < D
        k = tl.load(k_ptr + ptrs, mask=ld_mask, other=0.0)
        v = tl.load(v_ptr + ptrs, mask=ld_mask, other=0.0)
    else:
        k = tl.load(k_ptr + ptrs)
        v = tl.load(v_ptr + ptrs)
    # scores in log2 units: softmax scale and log2(e) folded into one fp32 multiply (exp2 below)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        # causal mask; for every stored row it also hides p >= hi (pos_row < kv_hi, and tiles
        # never cross a split end since splits are BLOCK_N multiples)
        seen = p[None, :] <= pos_row[:, None]
        if SLIDING:
            seen = seen & (p[None, :] + window > pos_row[:, None])
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    pr = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _tile_keys(b, j0, q_len, sl_ptr, stride_sl, window, TPT: tl.constexpr,
               BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """(ctx, n_tok, kv_lo, kv_hi) of a query tile: keys [kv_lo, kv_hi) are seen by some row."""
    kv_len = tl.load(sl_ptr + b * stride_sl)
    ctx = kv_len - q_len
    n_tok = tl.minimum(q_len - j0, TPT)
    kv_hi = ctx + j0 + n_tok
    if SLIDING:
        # the tile's first row sees keys from ctx + j0 + 1 - window on (tile-aligned down; all
        # operands kept >= 0: integer division rounds differently in the interpreter)
        kv_lo = (tl.maximum(ctx + j0 + 1 - window, 0) // BLOCK_N) * BLOCK_N
    else:
        kv_lo = kv_hi * 0
    return ctx, n_tok, kv_lo, kv_hi


@triton.jit
def _split_chunk(kv_lo, kv_hi, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                 CHUNK_SQRT: tl.constexpr):
    """(keys per split, splits that hold keys) of a tile's key range: the range cut into
    num_splits BLOCK_N-aligned pieces, none shorter than MIN_CHUNK (a multiple of BLOCK_N) or
    sqrt(CHUNK_SQRT * keys) (when CHUNK_SQRT > 0), so a short sequence under a long bound uses
    a few splits and the others exit at once. Stage 1 and the reduce both call this: the same
    inputs give the same split count in both."""
    n = kv_hi - kv_lo
    chunk = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, MIN_CHUNK)
    if CHUNK_SQRT > 0:
        # floor(sqrt(x)) exactly: the float root, whatever its rounding (an approximate sqrt
        # on the GPU), corrected by one either way, so both kernels agree on every count
        x = n * CHUNK_SQRT
        root = tl.sqrt(x.to(tl.float32)).to(tl.int32)
        root = tl.where(root * root > x, root - 1, root)
        root = tl.where((root + 1) * (root + 1) <= x, root + 1, root)
        chunk = tl.maximum(chunk, tl.cdiv(root, BLOCK_N) * BLOCK_N)
    return chunk, tl.cdiv(n, chunk)


# Not specialized on the values that change from step to step (Triton would compile a variant
# per value class: == 1, a multiple of 16, other): the batch size, the splits, the skip, and the
# block table's row stride (its width: the longest sequence's block count).
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "q_skip", "window", "stride_btb"])
def _paged_attn_stage1(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, sl_ptr, qsl_ptr, m_part, l_part, acc_part,
        qk_scale, num_seqs, num_splits, q_skip, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
        stride_btb, stride_btn, stride_sl,
        G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TPT: tl.constexpr,
        ONE_TILE_PER_SEQ: tl.constexpr, SPLIT: tl.constexpr, SLIDING: tl.constexpr,
        DOT_PREC: tl.constexpr, MIN_CHUNK: tl.constexpr, CHUNK_SQRT: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, j0, q_start, q_len = _locate_tile(pid_t, qsl_ptr, num_seqs, TPT, ONE_TILE_PER_SEQ)
    if ONE_TILE_PER_SEQ:
        skip = (q_len <= 0) | (q_len > TPT)        # longer ones belong to the "large" launch
    else:
        skip = (q_len <= q_skip) | (j0 >= q_len)
    if skip:
        return

    ctx, n_tok, kv_lo, kv_hi = _tile_keys(b, j0, q_len, sl_ptr, stride_sl, window, TPT, BLOCK_N,
                                          SLIDING)
    if SPLIT:
        chunk, active = _split_chunk(kv_lo, kv_hi, num_splits, BLOCK_N, MIN_CHUNK, CHUNK_SQRT)
        if pid_s >= active:                       # no keys here; the reduce reads only `active`
            return
        lo = kv_lo + pid_s * chunk
        hi = tl.minimum(lo + chunk, kv_hi)
    else:
        lo = kv_lo
        hi = kv_hi
    # Keys in [full_lo, full_end) are visible to every row: whole tiles there need no mask.
    # Below ctx + j0 + 1 (the first row's causal edge) ...
    if SLIDING:
        # ... and from the last row's window start ctx + j0 + n_tok - window on (tile-aligned up)
        full_lo = tl.minimum(tl.maximum(
            tl.cdiv(tl.maximum(ctx + j0 + n_tok - window, 0), BLOCK_N) * BLOCK_N, lo), hi)
    else:
        full_lo = lo
    full_end = tl.maximum(tl.minimum(hi, ((ctx + j0 + 1) // BLOCK_N) * BLOCK_N), full_lo)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    tok = j0 + offs_m // G
    head = pid_h * G + offs_m % G
    row_ok = (offs_m < TPT * G) & (tok < q_len)
    d_ok = offs_d < D
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)
    pos_row = ctx + tok

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    kv_head_off = pid_h * stride_ch

    # Block ids are fetched one tile ahead into registers, so the K/V gathers of a tile depend on
    # a loop-carried value rather than on a load of the same iteration (lets the software
    # pipeliner keep K/V loads in flight across iterations).
    # Loops that differ only in the constexpr MASKED flag: tiles wholly inside every row's
    # visible range compile without any mask arithmetic. The window's lower edge [lo, full_lo)
    # exists only when SLIDING (otherwise full_lo == lo).
    blk = _load_block_ids(bt_row_ptr, lo, hi, offs_n, stride_btn, BS)
    if SLIDING:
        for start in range(lo, full_lo, BLOCK_N):
            blk_next = _load_block_ids(bt_row_ptr, start + BLOCK_N, hi, offs_n, stride_btn, BS)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, qk_scale, start, hi, pos_row, window,
                                         blk, k_ptr, v_ptr, stride_cb, stride_cs, kv_head_off,
                                         offs_n, offs_d, BS, D, D_PAD, True, True, DOT_PREC)
            blk = blk_next
    for start in range(full_lo, full_end, BLOCK_N):
        blk_next = _load_block_ids(bt_row_ptr, start + BLOCK_N, hi, offs_n, stride_btn, BS)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, qk_scale, start, hi, pos_row, window, blk,
                                     k_ptr, v_ptr, stride_cb, stride_cs, kv_head_off, offs_n,
                                     offs_d, BS, D, D_PAD, False, SLIDING, DOT_PREC)
        blk = blk_next
    for start in range(full_end, hi, BLOCK_N):
        blk_next = _load_block_ids(bt_row_ptr, start + BLOCK_N, hi, offs_n, stride_btn, BS)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, qk_scale, start, hi, pos_row, window, blk,
                                     k_ptr, v_ptr, stride_cb, stride_cs, kv_head_off, offs_n,
                                     offs_d, BS, D, D_PAD, True, SLIDING, DOT_PREC)
        blk = blk_next

    if SPLIT:
        part = ((pid_t.to(tl.int64) * tl.num_programs(1) + pid_h) * num_splits + pid_s) * BLOCK_M
        tl.store(m_part + part + offs_m, m_i, mask=row_ok)
        tl.store(l_part + part + offs_m, l_i, mask=row_ok)
        tl.store(acc_part + (part + offs_m)[:, None] * D_PAD + offs_d[None, :], acc,
                 mask=row_ok[:, None])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "q_skip", "window"])
def _paged_attn_reduce(
        out_ptr, sl_ptr, qsl_ptr, m_part, l_part, acc_part, num_seqs, num_splits, q_skip, window,
        stride_ot, stride_oh, stride_sl,
        G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, TPT: tl.constexpr, ONE_TILE_PER_SEQ: tl.constexpr,
        SLIDING: tl.constexpr, MIN_CHUNK: tl.constexpr, CHUNK_SQRT: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    b, j0, q_start, q_len = _locate_tile(pid_t, qsl_ptr, num_seqs, TPT, ONE_TILE_PER_SEQ)
    if ONE_TILE_PER_SEQ:
        skip = (q_len <= 0) | (q_len > TPT)
    else:
        skip = (q_len <= q_skip) | (j0 >= q_len)
    if skip:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    tok = j0 + offs_m // G
    head = pid_h * G + offs_m % G
    row_ok = (offs_m < TPT * G) & (tok < q_len)
    base = (pid_t.to(tl.int64) * tl.num_programs(1) + pid_h) * num_splits
    _, _, kv_lo, kv_hi = _tile_keys(b, j0, q_len, sl_ptr, stride_sl, window, TPT, BLOCK_N,
                                    SLIDING)
    _, active = _split_chunk(kv_lo, kv_hi, num_splits, BLOCK_N, MIN_CHUNK, CHUNK_SQRT)

    m_tot = tl.full([BLOCK_M], _NEG, tl.float32)
    for s in range(active):
        m_s = tl.load(m_part + (base + s) * BLOCK_M + offs_m, mask=row_ok, other=_NEG)
        m_tot = tl.maximum(m_tot, m_s)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for s in range(active):
        rows = (base + s) * BLOCK_M + offs_m
        m_s = tl.load(m_part + rows, mask=row_ok, other=_NEG)
        l_s = tl.load(l_part + rows, mask=row_ok, other=0.0)
        a_s = tl.load(acc_part + rows[:, None] * D_PAD + offs_d[None, :], mask=row_ok[:, None],
                      other=0.0)
        w = tl.exp2(m_s - m_tot)
        l_tot += w * l_s
        acc += w[:, None] * a_s
    o = acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # the interpreter: pretend H200 so the heuristic is exercised the same way


def default_num_kv_splits(num_programs: int, max_seq_len: int, num_sms: int = 132, *,
                          per_sm: int = SPLIT_TARGET_PROGRAMS_PER_SM,
                          min_keys: int = MIN_KEYS_PER_SPLIT, max_splits: int = MAX_SPLITS) -> int:
    """Key-range splits so that num_programs * splits >= per_sm * num_sms, with no split shorter
    than min_keys: 1 for short contexts or grids that are already full."""
    if num_programs <= 0 or max_seq_len < 2 * min_keys:
        return 1
    want = -(-per_sm * num_sms // num_programs)
    return max(1, min(want, max_seq_len // min_keys, max_splits))


def prefill_config_for(max_query_len: int, dtype: torch.dtype) -> dict:
    """The query-tile launch's default config for a step whose chunks are at most max_query_len
    tokens (a host bound: under a CUDA graph, its token bucket): PREFILL_CONFIG, with
    PREFILL_WIDE_CONFIG over it at the lengths PREFILL_WIDE_AT names, for half dtypes."""
    lo, hi = PREFILL_WIDE_AT
    if dtype in (torch.float16, torch.bfloat16) and (max_query_len <= lo or max_query_len >= hi):
        return {**PREFILL_CONFIG, **PREFILL_WIDE_CONFIG}
    return PREFILL_CONFIG


def _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, max_query_len,
           max_seq_len, num_kv_splits, sliding_window):
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
               "seq_lens": seq_lens, "query_start_loc": query_start_loc}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"k_cache and v_cache must be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "differ")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must share strides, got {k_cache.stride()} and "
                         f"{v_cache.stride()}")
    _, H, D = q.shape
    _, BS, Hkv, Dc = k_cache.shape
    if Dc != D:
        raise ValueError(f"head dim of q ({D}) and of the caches ({Dc}) differ")
    if D < 1 or BS < 1 or Hkv < 1 or H < 1:
        raise ValueError(f"empty head/block dims: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if H % Hkv:
        raise ValueError(f"num query heads ({H}) must be a multiple of num kv heads ({Hkv})")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and caches ({k_cache.dtype}, {v_cache.dtype}) must share "
                         "a dtype")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("q and the caches must have a contiguous last (head) dim")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        if tensors[name].dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensors[name].dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got {tuple(block_tables.shape)}")
    B = block_tables.shape[0]
    if seq_lens.dim() != 1 or seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must be [B={B}], got {tuple(seq_lens.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != B + 1:
        raise ValueError(f"query_start_loc must be [B+1={B + 1}], got "
                         f"{tuple(query_start_loc.shape)}")
    if query_start_loc.stride(0) != 1:
        raise ValueError("query_start_loc must be contiguous")
    devs = {t.device for t in tensors.values()}
    if len(devs) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devs))}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)}")
        if out.device != q.device or out.stride(2) != 1:
            raise ValueError("out must be on q's device with a contiguous last dim")
    if q.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"paged_attention runs on CUDA tensors (or under TRITON_INTERPRET=1), "
                         f"got {q.device}")
    for name, val in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if not _is_int(val) or val < 0:
            raise ValueError(f"{name} must be a non-negative host int, got {val!r}")
    if num_kv_splits is not None and (not _is_int(num_kv_splits) or num_kv_splits < 1):
        raise ValueError(f"num_kv_splits must be a positive int or None, got {num_kv_splits!r}")
    if sliding_window is not None and (not _is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")


def _is_int(val) -> bool:
    if isinstance(val, (bool, torch.Tensor)):   # a tensor would mean a device read
        return False
    try:
        operator.index(val)
    except TypeError:
        return False
    return True


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *, max_query_len: int,
                    max_seq_len: int, out: torch.Tensor | None = None,
                    num_kv_splits: int | None = None,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged K/V (see module doc).

    q [T, H, D] (strided ok, last dim contiguous); k_cache/v_cache [NB, BS, Hkv, D] (views ok);
    block_tables [B, MAXB] int32; seq_lens [B] int32 (cached + new tokens); query_start_loc
    [B+1] int32. max_query_len / max_seq_len: host upper bounds of q_len / seq_lens. Returns out
    [T, H, D] in q's dtype; rows >= query_start_loc[B] are not written. num_kv_splits forces the
    split-K factor of the decode launch (None: default_num_kv_splits); the prefill launch, when
    there is one, always picks its own. sliding_window W (a host int, None: off): the query at
    position p sees only keys at positions > p - W."""
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                            max_query_len=max_query_len, max_seq_len=max_seq_len, out=out,
                            num_kv_splits=num_kv_splits, sliding_window=sliding_window)


def _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, *,
                     max_query_len, max_seq_len, out=None, num_kv_splits=None,
                     sliding_window=None, decode_config: dict | None = None,
                     prefill_config: dict | None = None, only_prefill_kernel: bool = False):
    """paged_attention with overrides of DECODE_CONFIG / prefill_config_for entries (bench sweeps,
    tests on tiny shapes; prefill_config may also carry "num_kv_splits") and only_prefill_kernel
    (send every sequence, decodes included, through the query-tile launch, to test it alone)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, max_query_len,
           max_seq_len, num_kv_splits, sliding_window)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    max_query_len, max_seq_len = operator.index(max_query_len), operator.index(max_seq_len)
    dec = {**DECODE_CONFIG, **(decode_config or {})}
    pre = {**prefill_config_for(max_query_len, q.dtype), **(prefill_config or {})}
    T, H, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    B = block_tables.shape[0]
    G = H // Hkv
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out
    D_PAD = max(16, _next_pow2(D))
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: no TF32 rounding
    sms = _num_sms(q.device)
    sliding = sliding_window is not None
    common = dict(qk_scale=float(scale) * _LOG2E, num_seqs=B,
                  window=operator.index(sliding_window) if sliding else 0,  # read only if SLIDING
                  stride_qt=q.stride(0), stride_qh=q.stride(1),
                  stride_ot=out.stride(0), stride_oh=out.stride(1),
                  stride_cb=k_cache.stride(0), stride_cs=k_cache.stride(1),
                  stride_ch=k_cache.stride(2),
                  stride_btb=block_tables.stride(0), stride_btn=block_tables.stride(1),
                  stride_sl=seq_lens.stride(0))

    def launch(cfg, n_tiles, one_tile, q_skip, splits):
        block_m = max(cfg["block_m"], _next_pow2(G), 16)
        block_n = cfg["block_n"] or max(16, min(128, cfg["block_n_elems"] // D_PAD))
        tpt = block_m // G
        split = splits > 1
        # the fewest keys a split takes (config "min_chunk"; default one tile), tile-aligned
        min_chunk = -(-(cfg.get("min_chunk") or block_n) // block_n) * block_n
        chunk_sqrt = int(cfg.get("chunk_sqrt") or 0) if split else 0   # (a constexpr: 0 = off)
        if split:  # partial (m, l, acc) per (tile, kv head, split, row); stream-ordered, graph-safe
            rows = n_tiles * Hkv * splits * block_m
            m_part = torch.empty(rows, dtype=torch.float32, device=q.device)
            l_part = torch.empty(rows, dtype=torch.float32, device=q.device)
            acc_part = torch.empty(rows * D_PAD, dtype=torch.float32, device=q.device)
        else:
            m_part = l_part = acc_part = out  # not read
        _paged_attn_stage1[(n_tiles, Hkv, splits)](
            q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
            m_part, l_part, acc_part, num_splits=splits, q_skip=q_skip, **common,
            G=G, D=D, D_PAD=D_PAD, BS=BS, BLOCK_M=block_m, BLOCK_N=block_n, TPT=tpt,
            ONE_TILE_PER_SEQ=one_tile, SPLIT=split, SLIDING=sliding, DOT_PREC=dot_prec,
            MIN_CHUNK=min_chunk, CHUNK_SQRT=chunk_sqrt, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
        if split:
            _paged_attn_reduce[(n_tiles, Hkv)](
                out, seq_lens, query_start_loc, m_part, l_part, acc_part, B, splits, q_skip,
                common["window"], out.stride(0), out.stride(1), seq_lens.stride(0),
                G=G, D=D, D_PAD=D_PAD, BLOCK_M=block_m, BLOCK_N=block_n, TPT=tpt,
                ONE_TILE_PER_SEQ=one_tile, SLIDING=sliding, MIN_CHUNK=min_chunk,
                CHUNK_SQRT=chunk_sqrt, num_warps=4, num_stages=1)
        return tpt

    def keys_per_tile(tpt):  # upper bound on the keys one tile reads (host ints only)
        return min(max_seq_len, sliding_window + tpt) if sliding else max_seq_len

    # decode launch: one program per (sequence, kv head, split) for every q_len <= its TPT
    small_tpt = max(dec["block_m"], _next_pow2(G), 16) // G
    if not only_prefill_kernel:
        splits = (operator.index(num_kv_splits) if num_kv_splits
                  else default_num_kv_splits(B * Hkv, keys_per_tile(small_tpt), sms))
        launch(dec, B, True, 0, splits)
    # prefill launch: query tiles of the longer sequences; skipped when none can exist
    if only_prefill_kernel or max_query_len > small_tpt:
        large_tpt = max(pre["block_m"], _next_pow2(G), 16) // G
        n_tiles = T // large_tpt + B            # static bound on sum_b ceil(q_len_b / TPT)
        busy_tiles = -(-min(T, B * max(max_query_len, 1)) // large_tpt)
        # its own heuristic only (num_kv_splits is the decode launch's): it splits only grids
        # smaller than PREFILL_TARGET_PROGRAMS_PER_SM * SMs, which bounds the partials' memory
        splits = pre.get("num_kv_splits") or default_num_kv_splits(
            busy_tiles * Hkv, keys_per_tile(large_tpt), sms,
            per_sm=PREFILL_TARGET_PROGRAMS_PER_SM, min_keys=PREFILL_MIN_KEYS_PER_SPLIT,
            max_splits=PREFILL_MAX_SPLITS)
        launch(pre, n_tiles, False, 0 if only_prefill_kernel else small_tpt, splits)
    return out


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------

def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """The readable spec, in float32 torch, one sequence at a time (reads device values: not for
    CUDA graphs). Rows that belong to no sequence come back as zeros."""
    T, H, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = H // Hkv
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(block_tables.shape[0]):
        s, e = qsl[b], qsl[b + 1]
        n, L = e - s, lens[b]
        if n <= 0:
            continue
        ctx = L - n
        pos = torch.arange(L, device=q.device)
        slots_blk = block_tables[b, pos // BS].long()
        k = k_cache[slots_blk, pos % BS].float()                    # [L, Hkv, D]
        v = v_cache[slots_blk, pos % BS].float()
        k = k.repeat_interleave(G, dim=1)                          # [L, H, D]
        v = v.repeat_interleave(G, dim=1)
        qq = q[s:e].float()                                        # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", qq, k) * scale
        qpos = ctx + torch.arange(n, device=q.device)
        hidden = pos[None, :] > qpos[:, None]                    # [n, L]: causal
        if sliding_window is not None:
            hidden |= pos[None, :] <= qpos[:, None] - sliding_window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[s:e] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out.to(q.dtype)
