"""Exact top-k of a register vector by radix select (Triton device functions).

The planner's TopK (`block_select.py`) and the reblock split (`reblock_split.py`) both need the
k largest values of a vector held by one program (or, for wide tree nodes, of a vector it
stores and re-reads in chunks), ties toward the lower position, with no sort.
Floats are mapped to order-preserving unsigned keys and the k-th largest key is built one bit
at a time from the top: 32 counting passes, each one compare and one reduction over the vector.
(8-bit passes with a 256-bin `tl.histogram` were tried and are slower here.)
The selection runs over two vectors: a row whose length is not a power of two can be held as a
power-of-two head and a short tail (`row_split`, `top_k_mask_pair`), so the passes cover about
n lanes instead of n padded to the next power of two; the one-vector forms pass one dead lane
as the second.
"""
import triton
import triton.language as tl


def row_split(n: int) -> tuple[int, int]:
    """(head, tail) lanes holding a row of n scores: half of n's next power of two, plus a quarter
    or a half of it where that holds the rest, else all of it in the head and one dead tail lane (so
    a kernel has one path for both). Three shapes per power of two, so a new clip length rebuilds
    the kernels only when its rows cross a quarter of a power of two."""
    npad = triton.next_power_of_2(n)
    head = npad // 2
    if head < 64 or n > head + head // 2:
        return npad, 1
    return head, head // 4 if n <= head + head // 4 else head // 2


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
def dead_lane():
    """A second vector of one dead lane (value 0, live False), for the one-vector forms."""
    return tl.zeros([1], tl.float32), tl.zeros([1], tl.int1)


@triton.jit
def kth_largest_key_pair(key, live, key_t, live_t, k):
    """The k-th largest of the uint32 keys of two vectors where `live` / `live_t` (k >= 1 and at
    most the live count; k = 0 gives the largest possible key, so that nothing lies above it)."""
    thresh = tl.zeros([], tl.uint32)
    for i in range(32):  # the largest t with at least k keys >= t, bit 31 first (a loop: 32
        # unrolled copies over a wide vector take Triton many seconds to compile)
        cand = with_bit(thresh, 31 - i)
        count = tl.sum((live & (key >= cand)).to(tl.int32), 0) + tl.sum((live_t & (key_t >= cand)).to(tl.int32), 0)
        thresh = tl.where(count >= k, cand, thresh)
    return thresh


@triton.jit
def kth_largest_key(key, live, k):
    """`kth_largest_key_pair` of one vector."""
    y, dead = dead_lane()
    return kth_largest_key_pair(key, live, float_key(y), dead, k)


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
def top_k_mask_pair(x, live, y, live_y, k):
    """Masks of the k largest fp32 values among the `live` lanes of x followed by the `live_y`
    lanes of y, ties toward the lower lane: every value above the k-th largest, then the first
    lanes equal to it, as many as fit. A row of n values held as a power-of-two head and a short
    tail (`row_split`) costs passes over about n lanes, not over n padded to the next power of
    two (1,134 key blocks: 1,280 lanes instead of 2,048)."""
    key = tl.where(live, float_key(x), 0)
    key_y = tl.where(live_y, float_key(y), 0)
    thresh = kth_largest_key_pair(key, live, key_y, live_y, k)
    above, above_y = live & (key > thresh), live_y & (key_y > thresh)
    tie, tie_y = live & (key == thresh), live_y & (key_y == thresh)
    room = k - tl.sum(above.to(tl.int32), 0) - tl.sum(above_y.to(tl.int32), 0)
    pick = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= room))
    room_y = room - tl.sum(tie.to(tl.int32), 0)
    return pick, above_y | (tie_y & (tl.cumsum(tie_y.to(tl.int32), 0) <= room_y))


@triton.jit
def top_k_mask(x, live, k):
    """`top_k_mask_pair` of one vector."""
    y, dead = dead_lane()
    return top_k_mask_pair(x, live, y, dead, k)[0]
