"""Reblock tiling (seed 001): per-head token layouts that group tokens with similar attention.

Metric (seed 001, section 05). Two queries want the same keys when their logit profiles K q_i
and K q_j point the same way; <K q_i, K q_j> = q_i^T K^T K q_j, so queries are compared by the
cosine of q^T L_K with L_K L_K^T = M_K = K^T K / N (uncentered second moment of the keys, plus a
small ridge relative to trace/d), and keys by the cosine of k^T L_Q. Moments are estimated per
(batch, head) from an evenly strided sample of the region's rows; the factor is a Cholesky
factor (`cholesky_ex`, no host sync). The small moment, factor and basis math runs in float64 and
a failed factorization falls back to the diagonal factor: in float32 the factorization of the
metric failed on the GPU (info != 0, NaN factor) for most heads of a structured scene, which
turned their features into zeros and their blocks into raster order (docs/performance-notes.md,
"Reblock v3").

Partition (section 06). Features are normalised in the full head dimension, then projected on
their top `FEATURE_DIMS` principal directions (subspace iteration, per head) and stored in half
precision (unit-scale coordinates; the tree's levels are bound by gathering them); the tree
computes with them in float32 on every device, so a tiling does not depend on where it is built. A
region of N rows is ceil(N / block_size) blocks; the root holds all blocks, and every node
splits its blocks into halves (floor, ceil) and its tokens by capacity: the left child takes
the tokens with the smallest projections on the node's split direction (found from a few
landmark members of the node: their top principal direction, refined by balanced 2-means
steps), exactly its capacity, a multiple of the block size. The region's last block is its
edge block (N mod block_size rows). Leaves are single blocks, in tree order. Every level is a
few batched ops over all (tree, node) pairs: nodes are padded to the level's widest (sizes at
one depth differ by at most one block); the features stay in token order and only the int32
token ids of every slot move. On the GPU Triton kernels find every node's split direction,
project, split by radix select and place the ids (kernels/reblock_split.py); the torch levels (the reference) split by
selection (kthvalue, ties by slot) and prefix sums and move the ids by one gather inside their
parent node through a static index map. No sort anywhere. Work is O(N log N) per head; the
shape-only schedule is built on the host once per (layout, block size, device) and cached; on
the GPU the partition is replayed from a CUDA graph.

Layout modes: `q_reuse_k` builds the key layout and queries reuse it; `independent` builds both
(queries by X_Q, keys by X_K) in one batched run. V always follows K. Context regions keep the
1D chunks of the cube tiling. Then every head keeps its tree or takes a fixed space-time tube
tiling cut into the same blocks, whichever holds more sampled attention mass (heads that attend
by position are served better by tubes; backend/head_choice.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kernels.reblock_reference import TINY, feature_dtype
from ..kernels.table import Kernels, reference_kernels
from .cache import ShapeCache
from .config import REBLOCK_LAYOUTS
from .head_choice import choose_tubes
from .layout import REFERENCE_VIDEO, TARGET_VIDEO, SequenceLayout
from .tiling import Tiling, chunk_tiles, golden_positions

MOMENT_SAMPLES = 8192  # rows per (batch, head) used to estimate moments and the feature basis
RIDGE = 1e-3  # ridge added to the second moment, relative to trace / d
FEATURE_DIMS = 16  # principal directions of the normalised features kept for the tree
BASIS_ITERATIONS = 4  # subspace iterations for those directions
LANDMARKS = 32  # members per node used to find its split direction (at least) ...
LEVEL_LANDMARKS = 2048  # ... and per level of one tree, so the first, widest splits get more

log = logging.getLogger("adaptive_sparse_attention")



@dataclass(frozen=True)
class Level:
    """Static slots of one tree level: `nodes` nodes of `width` slots each, tokens first.

    valid: bool [nodes, width], slot holds a token. left: long [nodes, 1], the left child's
    capacity (tokens); right: long [nodes, width], left + slot (where right-going slots start).
    Selection pads every node so that its left[i]-th smallest projection is the kth-smallest
    value of its row: fill [nodes, width] puts -inf in kth - left[i] padding slots and +inf in
    the others. landmarks: long [nodes, marks], slots spread over every node's tokens (an empty
    node's first slot). carry: long [nodes, 2, next width], the slot of its parent (after the
    split) that every slot of the two children takes; padding takes any slot (never read).
    sizes: int32 [2, nodes], tokens and left capacity of every node (the fused split's input).
    """

    nodes: int
    width: int
    marks: int
    kth: int
    valid: torch.Tensor
    fill: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor
    landmarks: torch.Tensor
    carry: torch.Tensor
    sizes: torch.Tensor


@dataclass(frozen=True)
class Schedule:
    """The shape-only part of one region's tree: its levels and the last level's slot that
    every block slot takes (`leaf_slots` [blocks * block_size], the dummy for padding)."""

    levels: tuple[Level, ...]
    leaf_slots: torch.Tensor


def build_schedule(length: int, block_size: int, device: torch.device) -> Schedule:
    """Static tree of a region of `length` rows cut into `block_size` blocks (edge block last)."""
    blocks = -(-length // block_size)
    short = blocks * block_size - length  # rows the edge block lacks

    def tokens(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        edge = ((hi == blocks) & (hi > lo)).long() * short
        return (hi - lo) * block_size - edge

    def width(lo: torch.Tensor, hi: torch.Tensor, tok: torch.Tensor) -> int:
        left = (hi - lo) // 2 * block_size  # the left child never holds the edge block
        return int((tok + left.max() - left).max())  # room for the selection's -inf padding

    lo, hi = torch.zeros(1, dtype=torch.long), torch.full((1,), blocks, dtype=torch.long)
    tok = tokens(lo, hi)
    levels = []
    while int((hi - lo).max()) > 1:
        nodes, w = lo.numel(), width(lo, hi, tok)
        mid = lo + (hi - lo) // 2
        left = (mid - lo) * block_size
        c_lo, c_hi = torch.stack([lo, mid], 1).reshape(-1), torch.stack([mid, hi], 1).reshape(-1)
        c_tok = tokens(c_lo, c_hi)
        c_w = width(c_lo, c_hi, c_tok) if int((c_hi - c_lo).max()) > 1 else int(c_tok.max())
        offset = torch.stack([torch.zeros_like(left), left], 1).view(nodes, 2, 1)
        carry = (offset + torch.arange(c_w)).clamp(max=w - 1)  # in range; padding is never read
        m = max(LANDMARKS, min(w, LEVEL_LANDMARKS // nodes))
        marks = golden_positions(m, tok.view(-1, 1))  # spread over each node's tokens; empty node: slot 0
        t = torch.arange(w)
        kth = int(left.max())
        fill = torch.where(t < (tok + kth - left).view(-1, 1), float("-inf"), float("inf"))
        levels.append(Level(nodes, w, m, kth, (t < tok.view(-1, 1)).to(device), fill.to(device),
                            left.view(-1, 1).to(device), (left.view(-1, 1) + t).to(device),
                            marks.to(device), carry.to(device),
                            torch.stack([tok, left]).to(torch.int32).to(device)))
        lo, hi, tok = c_lo, c_hi, c_tok
    nodes, w = lo.numel(), int(tok.max())
    leaf = hi > lo  # every non-empty node is now one block
    t = torch.arange(block_size)
    slots = torch.arange(nodes).view(-1, 1) * w + t
    slots = torch.where(t < tok.view(-1, 1), slots, torch.full_like(slots, nodes * w))[leaf]
    return Schedule(tuple(levels), slots.reshape(-1).to(device))


@dataclass(frozen=True)
class StaticLayout:
    """Shape-only part of a reblock tiling: per region in block order either the region's tree
    `Schedule` (video) or its 1D chunks as absolute rows [n * block_size] (context), and the
    tiling's block lengths and region block spans. Built on the host once, kept on the device."""

    parts: tuple[Schedule | torch.Tensor, ...]
    block_len: torch.Tensor
    region_blocks: tuple[tuple[int, int], ...]


def build_static(layout: SequenceLayout, block_size: int, device: torch.device) -> StaticLayout:
    """The `StaticLayout` of `layout`: a tree `Schedule` per video region, 1D chunks for context."""
    parts, lens, spans, lo = [], [], [], 0
    for seg in layout.regions():
        members, lengths = chunk_tiles(seg.length, block_size)  # a video region's edge block is last too
        if seg.region in (REFERENCE_VIDEO, TARGET_VIDEO):
            parts.append(build_schedule(seg.length, block_size, device))
        else:
            parts.append(torch.where(members >= 0, members + seg.start, members).reshape(-1).to(device))
        lens.append(lengths)
        spans.append((lo, lo + lengths.numel()))
        lo += lengths.numel()
    return StaticLayout(tuple(parts), torch.cat(lens).to(torch.int32).to(device), tuple(spans))


def cached_static(layout: SequenceLayout, block_size: int, device: torch.device) -> StaticLayout:
    """`build_static`, once per (block size, device), kept by the layout: it is built on the host."""
    return layout.cache.get("reblock_static", (block_size, str(device)), lambda: build_static(layout, block_size, device))


def ridge(m: torch.Tensor, relative: float) -> torch.Tensor:
    """m [..., n, n] plus (relative * trace / n + TINY) * I."""
    n = m.shape[-1]
    tr = m.diagonal(dim1=-2, dim2=-1).sum(-1)
    return m + (relative * tr / n + TINY).unsqueeze(-1).unsqueeze(-1) * torch.eye(n, dtype=m.dtype, device=m.device)


def cholesky_factor(m: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of symmetric PSD m [..., n, n], or the diagonal factor sqrt(diag m)
    (non-finite entries 0) where the factorization fails or is not finite; no host sync
    (`cholesky_ex`, then a select), so a failure can never hand on garbage or NaN."""
    L, info = torch.linalg.cholesky_ex(m)
    ok = (info == 0) & torch.isfinite(L).all(-1).all(-1)
    root = m.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()
    fallback = torch.diag_embed(torch.nan_to_num(root, nan=0.0, posinf=0.0))
    return torch.where(ok.unsqueeze(-1).unsqueeze(-1), L, fallback)


def orthonormalize(y: torch.Tensor) -> torch.Tensor:
    """Columns of y [..., n, r] made orthonormal by a shifted Cholesky QR (no host sync)."""
    g = ridge(y.transpose(-1, -2) @ y, 1e-4)  # the shift keeps rank-deficient y factorizable
    return torch.linalg.solve_triangular(cholesky_factor(g), y.transpose(-1, -2), upper=False).transpose(-1, -2)


def principal_basis(c: torch.Tensor, rank: int) -> torch.Tensor:
    """Top-`rank` eigenvector basis of symmetric PSD c [G, n, n] by subspace iteration: [G, n, rank]."""
    n = c.shape[-1]
    c = c / (c.diagonal(dim1=-2, dim2=-1).sum(-1) + TINY).view(-1, 1, 1)
    # deterministic dense start (no generator state): a fixed quasi-random matrix
    i = torch.arange(n, dtype=c.dtype, device=c.device).view(n, 1)
    j = torch.arange(rank, dtype=c.dtype, device=c.device).view(1, rank)
    y = torch.cos(0.7548776662 * (i + 1) * (j + 1) + 0.5698402910 * i)
    for _ in range(BASIS_ITERATIONS):
        y = orthonormalize(c @ y)
    return orthonormalize(y)


def metric_features(x: torch.Tensor, other: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
    """Tree features of rows x [G, N, D] under the metric of `other` [G, N, D]: [G, N, r] in
    `feature_dtype(x)`, on every device alike.

    Rows of x L (L L^T = other^T other / N + ridge) are normalised in the full dimension, then
    projected on their top r principal directions, estimated from the strided sample. The small
    moments, factor and basis ([G, D, D]) are factorized in float64, so the factorizations
    cannot fail by rounding (the ridge is far above the products' rounding). The products are
    the kernels' (`kernels.metric_gram`, `kernels.metric_project`): on Triton in x's dtype on
    tensor cores with fp32 accumulation, reading the strided sample in place; in torch in x's
    accumulation dtype.
    """
    kernels = reference_kernels() if kernels is None else kernels
    N, D = x.shape[1], x.shape[2]
    step = -(-N // MOMENT_SAMPLES)  # an evenly strided sample of the rows, read in place
    sample, rows = other[:, ::step], x[:, ::step]
    factor = cholesky_factor(ridge(kernels.metric_gram(sample), RIDGE))
    basis = principal_basis(kernels.metric_gram(rows, factor), min(FEATURE_DIMS, D))  # moment of the normalised rows
    return kernels.metric_project(x, factor, factor @ basis)


def partition(z: torch.Tensor, schedule: Schedule, kernels: Kernels | None = None) -> torch.Tensor:
    """Capacity-exact tree partition of features z [G, N, r]: block slots -> row [G, blocks * bs], -1 pads.

    The features stay in token order; what moves from level to level are the int32 token ids of
    every node's slots (`kernels.partition_level`, one call per level)."""
    kernels = reference_kernels() if kernels is None else kernels
    G, N, _ = z.shape
    rows = torch.arange(N, device=z.device, dtype=torch.int32).expand(G, 1, N)  # the root is every token
    for level in schedule.levels:
        rows = kernels.partition_level(z, rows, level)
    rows = torch.nn.functional.pad(rows.reshape(G, -1), (0, 1), value=-1)
    return torch.index_select(rows, 1, schedule.leaf_slots).long()


@dataclass
class CapturedPartition:
    """`partition` of a static input `z` captured as a CUDA graph; `schedule` keeps the static
    tensors the graph reads alive."""

    graph: "torch.cuda.CUDAGraph"
    z: torch.Tensor
    out: torch.Tensor
    schedule: Schedule


def capture_partition(z: torch.Tensor, schedule: Schedule, kernels: Kernels) -> CapturedPartition:
    """`partition` of a copy of z captured as a CUDA graph (after one warm-up run on a side stream);
    raises RuntimeError where capture fails."""
    static = z.clone()
    stream = torch.cuda.Stream(z.device)
    stream.wait_stream(torch.cuda.current_stream(z.device))
    with torch.cuda.stream(stream):
        partition(static, schedule, kernels)  # warm-up outside the graph (workspaces, lazy init)
    torch.cuda.current_stream(z.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = partition(static, schedule, kernels)
    return CapturedPartition(graph, static, out, schedule)


def capture_or_none(z: torch.Tensor, schedule: Schedule, kernels: Kernels) -> CapturedPartition | None:
    """`capture_partition`, or None where capture fails (said once, as the result is cached):
    the partition then keeps working eagerly."""
    try:
        return capture_partition(z, schedule, kernels)
    except RuntimeError as e:
        log.warning("reblock: CUDA graph capture failed (%s); running the partition eagerly", e)
        return None


def run_partition(z: torch.Tensor, schedule: Schedule, block_size: int, kernels: Kernels | None = None,
                  cache: ShapeCache | None = None, region: int = 0) -> torch.Tensor:
    """`partition`, replayed on the GPU from a CUDA graph kept in `cache` (the layout's; its ~50
    small ops per level are bound by host launch overhead) per (region, shape, dtype, device,
    block size, kernels); eager without a cache, off the GPU, where `cache.graphs` is off (calls whose
    shapes are never seen again, such as the kernel warm-up), while the caller is itself capturing,
    or where capture failed (cached as None: said once)."""
    kernels = reference_kernels() if kernels is None else kernels
    if cache is None or not cache.graphs or not z.is_cuda or torch.cuda.is_current_stream_capturing():
        return partition(z, schedule, kernels)
    key = (region, tuple(z.shape), z.dtype, str(z.device), block_size, kernels.partition_level.backend)
    with torch.cuda.device(z.device):
        captured = cache.get("partition_graph", key, lambda: capture_or_none(z, schedule, kernels))
        if captured is None:
            return partition(z, schedule, kernels)
        captured.z.copy_(z)
        captured.graph.replay()
        return captured.out.clone()


def check_inputs(q: torch.Tensor, k: torch.Tensor, layout: SequenceLayout, block_size: int, layout_mode: str) -> None:
    """Raise ValueError naming the argument and its value when `reblock_tiling` cannot run on these
    inputs (decided from metadata only)."""
    if layout_mode not in REBLOCK_LAYOUTS:
        raise ValueError(f"reblock_tiling: layout_mode={layout_mode!r} is not allowed: expected one of "
                         + ", ".join(repr(m) for m in REBLOCK_LAYOUTS))
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"reblock_tiling: block_size={block_size!r} is not allowed: expected a positive integer")
    if not isinstance(layout, SequenceLayout):
        raise ValueError(f"reblock_tiling: layout must be a SequenceLayout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"reblock_tiling: {name} must be a [B, H, S, D] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"reblock_tiling: {name}.dtype={t.dtype} is not allowed: expected a floating dtype")
    if q.shape != k.shape or q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"reblock_tiling: q and k must share shape, dtype and device, got {tuple(q.shape)} "
                         f"{q.dtype} {q.device} and {tuple(k.shape)} {k.dtype} {k.device}")
    if q.shape[2] != layout.total:
        raise ValueError(f"reblock_tiling: sequence length {q.shape[2]} does not match the layout's "
                         f"{layout.total} rows ({layout!r})")


def reblock_tiling(q: torch.Tensor, k: torch.Tensor, layout: SequenceLayout, block_size: int,
                   layout_mode: str = "q_reuse_k", ratio: float = 0.1, tubes: bool = True,
                   kernels: Kernels | None = None) -> Tiling:
    """Adaptive per-head tiling of q, k [B, H, S, D] (model order).

    Args:
        q, k: the call's queries and keys.
        layout: their segments; block_size: rows per block.
        layout_mode: "q_reuse_k" (queries reuse the key layout) or "independent".
        ratio: the routing ratio the per-head tube choice scores at.
        tubes: every head keeps the tree or takes a fixed space-time tube, whichever holds more
            sampled attention mass in its routing budget at `ratio` (backend/head_choice.py);
            False keeps the tree for every head.
        kernels: the call's kernels (`kernels/table.py`; default: the torch reference).
    Returns:
        The tiling; its permutations are [B, H, J * block_size]."""
    check_inputs(q, k, layout, block_size, layout_mode)
    B, H, _, D = q.shape
    static = cached_static(layout, block_size, q.device)
    if B * H == 0:  # an empty batch or no heads: nothing to lay out, every tiling is the same empty one
        empty = torch.empty(B, H, static.block_len.numel() * block_size, dtype=torch.int32, device=q.device)
        return Tiling(block_size, empty, empty, static.block_len, tuple(layout.regions()), static.region_blocks)
    sides = 2 if layout_mode == "independent" else 1
    pieces = []
    for seg, part in zip(layout.regions(), static.parts):
        if not isinstance(part, Schedule):
            pieces.append(part.expand(sides, B, H, -1))
            continue
        qs = q[:, :, seg.start:seg.stop].reshape(B * H, seg.length, D)
        ks = k[:, :, seg.start:seg.stop].reshape(B * H, seg.length, D)
        z = metric_features(ks, qs, kernels)  # keys under the queries' metric
        if sides == 2:
            z = torch.cat([metric_features(qs, ks, kernels), z])  # queries under the keys' metric
        members = run_partition(z, part, block_size, kernels, layout.cache, seg.start).view(sides, B, H, -1)
        pieces.append(torch.where(members >= 0, members + seg.start, members))
    perm = torch.cat(pieces, dim=-1).to(torch.int32)
    if tubes:  # every layout has one target video, its last region
        perm = choose_tubes(q, k, perm, layout, block_size, static.region_blocks[-1], ratio, kernels)
    q_perm = perm[0]
    k_perm = perm[1] if sides == 2 else q_perm
    return Tiling(block_size, q_perm, k_perm, static.block_len, tuple(layout.regions()), static.region_blocks)
