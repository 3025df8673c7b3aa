"""Fused Triton level of the reblock tree: project, split by capacity and place the token ids.

`backend/reblock.partition` splits each node of a level so that the left child takes the `left`
smallest projections on the node's direction (ties by slot). On the torch path that is a
feature gather, a projection, a selection, two scans, a scatter and the gathers of a static
index map (about fifteen kernels over every slot). Here one program per (tree, node) gathers its
tokens' feature rows (the features stay in token order; only the int32 ids move between
levels), projects them in a fixed order (sum over i of d_i z_i, i ascending), picks the `left`
smallest by a radix select (`radix_select`, exact, ties by slot, no sort) and writes every id
straight to its slot in the child. A node of up to `CHUNK` slots is held in registers. A wider
one (the first levels) gets its keys from a separate kernel spread over many programs, then is
walked in chunks: a sample of its keys brackets the threshold, so the counting passes run over
the few keys inside the bracket. Same rank rule as the torch split (tested against it in the
interpreter, where both round the projection alike; on the GPU the kernel's fused
multiply-adds may round differently).

Importing this module imports Triton: `family.py` imports it only when a call resolves to it.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ...errors import SparseAttentionError
from ..reblock_rule import REFINE_STEPS, SQUARINGS
from .radix_select import float_key, kth_largest_key, kth_largest_key_in_memory, top_k_mask

CHUNK = 8192  # slots one program holds in registers (32 per thread at 8 warps)
WIDE_CHUNK = 2048  # chunk of a wide node's passes when there are at least FEW_PROGRAMS programs
FEW_PROGRAMS = 128  # about one per SM of a data-centre GPU (H200: 132); fewer take CHUNK-wide chunks
KEY_BLOCK = 1024  # wide nodes: slots per program of the projection ...
SAMPLE = 4096  # ... keys sampled to bracket the split's threshold ...
MARGIN = 128  # ... MARGIN sample ranks either side of its expected rank (4 standard deviations of the
# rank of a random sample at a balanced split, so the full selection almost never runs) ...
CAP = 8192  # ... and at most CAP keys inside the bracket (about 6% of a node's keys: roots up to ~130k keys fit)
TINY = tl.constexpr(1e-30)  # floor of the norms (as in backend/reblock.py)
FEATURE_DTYPES = (torch.float16, torch.float32)  # feature storage; loaded to fp32


@triton.jit
def _landmark_rows(Z, Rows, Landmarks, g, node, i, j, N, m, r, sr_g, sr_n):
    """Feature rows [len(i), RP] of landmarks i of a node: slot -> token id -> row of z."""
    live = i < m
    slot = tl.load(Landmarks + node * m + i, mask=live, other=0)
    ids = tl.load(Rows + g * sr_g + node * sr_n + slot, mask=live, other=0)
    return tl.load(Z + (g * N + ids.to(tl.int64))[:, None] * r + j[None, :], mask=live[:, None] & (j[None, :] < r),
                   other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=['N', 'nodes', 'm', 'sr_g', 'sr_n'],
            do_not_specialize_on_alignment=['Landmarks'])
def _split_directions(Z, Rows, Landmarks, Out, N, nodes, m, r, sr_g, sr_n, RP: tl.constexpr, MP: tl.constexpr,
                      CH: tl.constexpr, SQUARINGS: tl.constexpr, STEPS: tl.constexpr):
    gn = tl.program_id(0).to(tl.int64)
    g = gn // nodes
    node = gn % nodes
    i = tl.arange(0, MP)
    j = tl.arange(0, RP)
    live = i < m
    x = _landmark_rows(Z, Rows, Landmarks, g, node, i, j, N, m, r, sr_g, sr_n)
    total = tl.sum(x, 0)
    c = tl.zeros([RP, RP], tl.float32)
    for start in range(0, m, CH):  # centred covariance, CH landmarks per product (small shared memory)
        ic = start + tl.arange(0, CH)
        xc = _landmark_rows(Z, Rows, Landmarks, g, node, ic, j, N, m, r, sr_g, sr_n)
        xc = tl.where(ic[:, None] < m, xc - total[None, :] / m, 0.0)
        c += tl.dot(tl.trans(xc), xc, input_precision="ieee")
    c = c / tl.maximum(tl.sqrt(tl.sum(tl.sum(c * c, 1), 0)), TINY)
    for _ in tl.static_range(SQUARINGS):
        c = tl.dot(c, c, input_precision="ieee")
    best = tl.argmax(tl.sum(c * c, 0), 0)  # the largest column (first on ties, like torch)
    d = tl.sum(tl.where(j[None, :] == best, c, 0.0), 1)
    for _ in tl.static_range(STEPS):
        key = tl.where(live, float_key(tl.sum(x * d[None, :], 1)), 0)
        thresh = kth_largest_key(key, live, m - (m + 1) // 2 + 1)  # the (m + 1) // 2-th smallest
        d = 2 * tl.sum(tl.where((live & (key > thresh))[:, None], x, 0.0), 0) - total
    d = d / tl.maximum(tl.sqrt(tl.sum(d * d, 0)), TINY)
    tl.store(Out + gn * r + j, d, mask=j < r)


@triton.jit
def _project(Z, Dir, g, gn, ids, live, N, R: tl.constexpr):
    """fp32 projections of the tokens `ids` of tree g on direction row gn, summed over i in order."""
    row = Z + (g * N + ids.to(tl.int64)) * R
    proj = tl.zeros(ids.shape, tl.float32)
    for i in tl.static_range(R):
        proj += tl.load(Dir + gn * R + i) * tl.load(row + i, mask=live, other=0.0).to(tl.float32)
    return proj


@triton.jit
def _place(RowsOut, gn, out_width, slot, go_left, before, ids, live):
    """Store ids to the children: left-goers first in slot order (child 0), the rest (child 1);
    `before` counts the left-goers up to and including every slot."""
    pos = tl.where(go_left, before - 1, slot - before)
    child = gn * 2 + tl.where(go_left, 0, 1)
    tl.store(RowsOut + child * out_width + pos, ids, mask=live)


@triton.jit
def _bracketed_kth_key(keys, cand, tok, left, BLOCK: tl.constexpr, SAMPLE: tl.constexpr, MARGIN: tl.constexpr,
                       CAP: tl.constexpr):
    """`kth_largest_key_in_memory(keys, tok, left)` in about two passes instead of 32, and how
    many keys lie above it: the keys of SAMPLE evenly spaced slots bracket the left-th largest
    key (MARGIN sample ranks on either side of its expected rank); one pass counts the keys above
    the bracket and copies those inside it to `cand`; if the k-th key lies inside and at most CAP
    keys do, it is selected among them in registers, which also count the keys above it.
    Otherwise (ties, a skewed node) the full selection and a counting pass run. Exact either
    way: the result is the same key and count."""
    n = tl.maximum(tok, 1)
    s = tl.arange(0, SAMPLE)
    sample = tl.load(keys + (s.to(tl.int64) * n) // SAMPLE, mask=tok > 0, other=0).to(tl.uint32, bitcast=True)
    every = s < SAMPLE
    rank = (left.to(tl.int64) * SAMPLE) // n  # expected rank of the k-th key among the sample's, from the top
    hi = kth_largest_key(sample, every, tl.maximum(rank - MARGIN, 0).to(tl.int32))  # rank 0: the largest key
    low = kth_largest_key(sample, every, tl.minimum(rank + MARGIN, SAMPLE).to(tl.int32))
    lo = tl.where(rank + MARGIN < SAMPLE, low, 0)  # past the sample's smallest key: every key
    offs = tl.arange(0, BLOCK)
    above = 0
    inside = 0
    for start in range(0, tok, BLOCK):
        live = start + offs < tok
        key = tl.load(keys + start + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
        above += tl.sum((live & (key > hi)).to(tl.int32), 0)
        inb = live & (key >= lo) & (key <= hi)
        pos = inside + tl.cumsum(inb.to(tl.int32), 0) - 1
        tl.store(cand + pos, key.to(tl.int32, bitcast=True), mask=inb & (pos < CAP))
        inside += tl.sum(inb.to(tl.int32), 0)
    if (above < left) & (above + inside >= left) & (inside <= CAP):
        c = tl.arange(0, CAP)
        held = c < inside
        few = tl.load(cand + c, mask=held, other=0).to(tl.uint32, bitcast=True)
        thresh = kth_largest_key(few, held, left - above)
        above += tl.sum((held & (few > thresh)).to(tl.int32), 0)  # keys below the bracket are below it too
    else:
        thresh = kth_largest_key_in_memory(keys, tok, left, BLOCK)
        above = 0
        for start in range(0, tok, BLOCK):
            live = start + offs < tok
            key = tl.load(keys + start + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
            above += tl.sum((live & (key > thresh)).to(tl.int32), 0)
    return thresh, above


@triton.jit(do_not_specialize=['N', 'nodes', 'width'],
            do_not_specialize_on_alignment=['Tokens'])
def _node_keys(Z, Dir, Rows, Tokens, Keys, N, nodes, width, BLOCK: tl.constexpr, R: tl.constexpr):
    """Keys (float_key of minus the projection) of one BLOCK of a wide node's slots: the wide
    nodes' projections in parallel over many programs (one program per node ran the root at
    the bandwidth of one SM)."""
    node = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    gn = g * nodes + node
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < tl.load(Tokens + node)
    ids = tl.load(Rows + gn * width + offs, mask=live, other=0)
    key = float_key(-_project(Z, Dir, g, gn, ids, live, N, R))
    tl.store(Keys + gn * width + offs, key.to(tl.int32, bitcast=True), mask=live)


@triton.jit(do_not_specialize=['N', 'nodes', 'width', 'out_width'],
            do_not_specialize_on_alignment=['Tokens', 'Left'])
def _split_level(Z, Dir, Rows, Tokens, Left, Keys, Cand, RowsOut, N, nodes, width, out_width,
                 R: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr, SAMPLE: tl.constexpr,
                 MARGIN: tl.constexpr, CAP: tl.constexpr):
    node = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    gn = g * nodes + node  # (tree, node) row
    tok = tl.load(Tokens + node)
    left = tl.load(Left + node)
    offs = tl.arange(0, BLOCK)
    rows = Rows + gn * width
    if not WIDE:
        live = offs < tok
        ids = tl.load(rows + offs, mask=live, other=0)
        go_left = top_k_mask(-_project(Z, Dir, g, gn, ids, live, N, R), live, left)
        _place(RowsOut, gn, out_width, offs, go_left, tl.cumsum(go_left.to(tl.int32), 0), ids, live)
    else:
        keys = Keys + gn * width  # written by _node_keys
        thresh, above = _bracketed_kth_key(keys, Cand + gn * CAP, tok, left, BLOCK, SAMPLE, MARGIN, CAP)
        room = left - above  # ties at the threshold that still go left, the first in slot order
        ties_seen = 0
        left_seen = 0
        for start in range(0, tok, BLOCK):
            live = start + offs < tok
            key = tl.load(keys + start + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
            tie = live & (key == thresh)
            go_left = (live & (key > thresh)) | (tie & (ties_seen + tl.cumsum(tie.to(tl.int32), 0) <= room))
            before = left_seen + tl.cumsum(go_left.to(tl.int32), 0)
            ids = tl.load(rows + start + offs, mask=live, other=0)
            _place(RowsOut, gn, out_width, start + offs, go_left, before, ids, live)
            ties_seen += tl.sum(tie.to(tl.int32), 0)
            left_seen += tl.sum(go_left.to(tl.int32), 0)


def split_directions_triton(z: torch.Tensor, rows: torch.Tensor, landmarks: torch.Tensor, squarings: int,
                            steps: int) -> torch.Tensor:
    """Split direction of every node from the features of its landmarks -> unit fp32 [G, nodes, r].

    z fp16/fp32 [G, N, r] (features in token order, used in fp32), rows int32 [G, nodes, width]
    (token ids of every node's slots, any strides), landmarks int64 [nodes, m] (the slots whose
    tokens are the landmarks). One program per (tree, node) gathers its landmarks' features
    itself and does what `backend/reblock.split_directions` does with `landmark_features` (top principal
    direction by `squarings` squarings of the normalised centred covariance, then `steps`
    balanced 2-means steps whose median is a radix select), with fp32 products in a different
    order, so the directions agree up to rounding.
    """
    G, nodes, _ = rows.shape
    m, r = landmarks.shape[-1], z.shape[-1]
    if z.dim() != 3 or z.shape[0] != G or z.dtype not in FEATURE_DTYPES:
        raise SparseAttentionError(f"split_directions_triton: z must be fp16 or fp32 [G={G}, N, r], got {z.dtype} {tuple(z.shape)}")
    if (rows.dtype != torch.int32 or rows.stride(-1) != 1 or landmarks.shape != (nodes, m)
            or landmarks.dtype != torch.int64):
        raise SparseAttentionError(f"split_directions_triton: rows must be int32 [G, nodes, width] with unit last stride and "
                         f"landmarks int64 [nodes={nodes}, m], got {rows.dtype} {tuple(rows.shape)} and "
                         f"{landmarks.dtype} {tuple(landmarks.shape)}")
    out = torch.empty(G, nodes, r, dtype=torch.float32, device=z.device)
    mp, rp = max(16, triton.next_power_of_2(m)), max(16, triton.next_power_of_2(r))
    _split_directions[(G * nodes,)](z.contiguous(), rows, landmarks.contiguous(), out, z.shape[1], nodes, m, r,
                                    rows.stride(0), rows.stride(1), RP=rp, MP=mp, CH=min(mp, 64),
                                    SQUARINGS=squarings, STEPS=steps, num_warps=max(1, min(8, mp // 256)))
    return out


def split_level_triton(z: torch.Tensor, rows: torch.Tensor, direction: torch.Tensor, tokens: torch.Tensor,
                       left: torch.Tensor, out_width: int) -> torch.Tensor:
    """Split every node of a level and place its token ids in the next level.

    z fp16/fp32 [G, N, r] (features in token order, used in fp32), rows int32 [G, nodes, width]
    (token ids, tokens first in every node), direction fp32 [G, nodes, r]; tokens, left int32
    [nodes] (tokens per node; the left child's capacity). Returns int32 [G, 2 * nodes, out_width]: child 0 of node i
    takes the `left` smallest projections (ties by slot), child 1 the rest, both in slot order;
    slots past a child's tokens are 0.
    """
    G, nodes, width = rows.shape
    r = z.shape[-1]
    if z.dim() != 3 or z.shape[0] != G or z.dtype not in FEATURE_DTYPES:
        raise SparseAttentionError(f"split_level_triton: z must be fp16 or fp32 [G={G}, N, r], got {z.dtype} {tuple(z.shape)}")
    if rows.dtype != torch.int32 or direction.shape != (G, nodes, r) or direction.dtype != torch.float32:
        raise SparseAttentionError(f"split_level_triton: rows must be int32 [G, nodes, width] and direction fp32 [G, nodes, r={r}], "
                         f"got {rows.dtype} {tuple(rows.shape)} and {direction.dtype} {tuple(direction.shape)}")
    out = rows.new_zeros(G, 2 * nodes, out_width)
    block = min(triton.next_power_of_2(width), CHUNK)
    wide = width > block
    if wide and G * nodes >= FEW_PROGRAMS:  # enough programs to fill the GPU: smaller chunks fit more per SM
        block = WIDE_CHUNK
    z, direction, rows = z.contiguous(), direction.contiguous(), rows.contiguous()
    keys = cand = out
    if wide:
        keys = torch.empty(G, nodes, width, dtype=torch.int32, device=rows.device)
        cand = torch.empty(G, nodes, CAP, dtype=torch.int32, device=rows.device)
        _node_keys[(triton.cdiv(width, KEY_BLOCK), nodes, G)](z, direction, rows, tokens, keys, z.shape[1], nodes,
                                                             width, BLOCK=KEY_BLOCK, R=r, num_warps=4)
    _split_level[(nodes, G)](z, direction, rows, tokens, left, keys, cand, out,
                             z.shape[1], nodes, width, out_width, R=r, BLOCK=block, WIDE=wide, SAMPLE=SAMPLE,
                             MARGIN=MARGIN, CAP=CAP, num_warps=max(1, min(8, block // 512)))
    return out


def partition_level_triton(z: torch.Tensor, rows: torch.Tensor, level: Any) -> torch.Tensor:
    """One tree level on the Triton kernels: every node's split direction from its landmarks, then
    the split and the placement of its token ids in the next level (int32 [G, 2 * nodes, next
    width]); the twin of `reblock_reference.partition_level_torch`."""
    direction = split_directions_triton(z, rows, level.landmarks, SQUARINGS, REFINE_STEPS)
    return split_level_triton(z, rows, direction, level.sizes[0], level.sizes[1], level.carry.shape[-1])
