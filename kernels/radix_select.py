"""Exact top-k of a register vector by radix select (Triton device functions).

The planner's TopK (`block_select.py`) and the reblock split (`reblock_split.py`) both need the
k largest values of a vector held by one program (or, for wide tree nodes, of a vector it
stores and re-reads in chunks), ties toward the lower position, with no sort.
Floats are mapped to order-preserving unsigned keys and the k-th largest key is built one bit
at a time from the top: 32 counting passes, each one compare and one reduction over the vector.
(8-bit passes with a 256-bin `tl.histogram` were slower on the H200: docs/performance-notes.md.)
"""
import triton
import triton.language as tl


@triton.jit
def float_key(x):
    """uint32 keys in the order of the fp32 values x (-0.0 and 0.0 get the same key, as they
    compare equal): positives get the sign bit set, negatives have every bit flipped."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # x + 0.0 turns -0.0 into 0.0
    return tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)


@triton.jit
def with_bit(thresh, bit):
    """thresh (uint32) with bit number `bit` set."""
    return thresh | (tl.full([], 1, tl.uint32) << (tl.zeros([], tl.uint32) + bit))


@triton.jit
def kth_largest_key(key, live, k):
    """The k-th largest of the uint32 keys where `live` (k >= 1 and at most the live count; k = 0
    gives the largest possible key, so that nothing lies above it)."""
    thresh = tl.zeros([], tl.uint32)
    for i in range(32):  # the largest t with at least k keys >= t, bit 31 first (a loop: 32
        # unrolled copies over a wide vector take Triton many seconds to compile)
        cand = with_bit(thresh, 31 - i)
        thresh = tl.where(tl.sum((live & (key >= cand)).to(tl.int32), 0) >= k, cand, thresh)
    return thresh


@triton.jit
def kth_largest_key_in_memory(Keys, n, k, BLOCK: tl.constexpr):
    """`kth_largest_key` of n uint32 keys stored (bitcast to int32) at Keys, read in BLOCK-wide
    chunks on every pass: for vectors too wide for one program's registers."""
    offs = tl.arange(0, BLOCK)
    thresh = tl.zeros([], tl.uint32)
    for i in range(32):
        cand = with_bit(thresh, 31 - i)
        count = 0
        for start in range(0, n, BLOCK):
            live = start + offs < n
            key = tl.load(Keys + start + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
            count += tl.sum((live & (key >= cand)).to(tl.int32), 0)
        thresh = tl.where(count >= k, cand, thresh)
    return thresh


@triton.jit
def top_k_mask(x, live, k):
    """Mask of the k largest fp32 values of x among the `live` lanes, ties toward the lower lane:
    every value above the k-th largest, then the first lanes equal to it, as many as fit."""
    key = tl.where(live, float_key(x), 0)
    thresh = kth_largest_key(key, live, k)
    above = live & (key > thresh)
    tie = live & (key == thresh)
    room = k - tl.sum(above.to(tl.int32), 0)
    return above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= room))
