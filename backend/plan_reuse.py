"""Plans reused across evaluated steps: the rule, its check, and the store that owns the kept plans.

One `PlanSlot` holds the plan of one (branch, block, shape, head group) from its last evaluated
step: the tiling, the routing (q2k tables) and the block means of Q and K it was routed on. The
next evaluated step of that slot reuses the tiling and the routing (the tail summaries are always
built from the step's own K and V) unless one of these holds, and then plans afresh:
- nothing is kept yet, or the step's facts differ (shape, dtype, device, or a setting the plan
  depends on: tiling, reblock layout, ratio, scope, block size, routing scores, kernels);
- the check failed: the predicted drift of the block means passed `DRIFT_LIMIT`.

The check. At every step that reuses a plan, the block means of Q and K on the kept tiling (the
planner needs them anyway, for the tail) are compared with the means the kept routing was chosen
on, over the sparse span of blocks: drift = max over (batch, head, Q or K) of
||mean - mean_at_build|| / ||mean_at_build||. Denoising moves Q/K with the sigma, and a shifted
schedule's sigma gaps grow towards its end (shift 10 at 8 steps: 0.024 early, 0.18 last), so the drift
is tracked as a rate per unit of sigma: rate = (drift - previous drift) / (previous sigma - sigma)
(the previous drift being 0 at the build), and the next step's drift is predicted as
drift + rate x (sigma - next sigma), the next sigma being the schedule's (`PlanSlot.at`). The plan is
rebuilt at the next step when the prediction passes the store's limit (`DRIFT_LIMIT`). A rebuilt plan
carries the last rate seen before it: when rate x the next gap alone passes the limit (late,
fast-moving steps), the step after the rebuild plans afresh too. Without the sigmas (a caller that
gives none) every gap counts as one step: the prediction is drift + (drift - previous drift).

No host synchronisation on the device's current work: the check is a tensor on the device; its
verdict is copied to the host asynchronously (pinned memory and an event on CUDA) and read at the
slot's next evaluated step, one model call or more later, when the device has long finished it. The
decision therefore lags one step. A verdict not ready yet (the event not reached: the host ran a whole
step ahead) is waited for: the device then still holds a step of queued work, so the wait starves it
of nothing, and the decision, hence the output's bits, never depends on timing. Selecting between old
and new plans with `torch.where` would need the new plan built every step and save nothing.

Ownership: a `PlanStore` belongs to one patched model's run state (`nodes/run_tracker.py`), holds at
most `MAX_SLOTS` slots (least recently used first out) and is cleared when the run ends. Steps a step
cache (EasyCache) skipped never reach the planner, so they do not count. A slot keeps the plan's
permutations, its q2k table and the bf16 block means on the device (docs/node-details.md has the size
at 10 s), and the store keeps plans only within a memory budget per device (`memory_budget`: a share
of the GPU's memory, fixed so the same inputs give the same bits): a plan that would pass it is used
for its step and not kept, the store says so once, and that slot's next step plans afresh (counted
as "memory budget"). Blocks are called in the same order every step, so the first blocks of a run
keep their plans and the others plan every step; no slot evicts another's plan on the way.

`plan_reuse="auto"` decides once per run and shape, at its first plan (`PlanStore.decide`): the plan's
measured bytes times the slots the run will fill (`Estimate`: the blocks that run sparse, the cond/uncond
branches, the head groups), plus what other shapes keep already, against the same budget. Where that fits,
the shape's plans are kept as with "on"; where it does not, every block of the shape plans afresh, as with
"off", so the node's extra memory gives way first. Either verdict is said once, with the numbers.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import torch

from ..errors import SparseAttentionError
from ..kernels.plan import Tiling
from ..notices import Notices
from .config import SparseConfig

DRIFT_LIMIT = 0.08  # predicted relative drift of the block means that forces a rebuild (tuned on the bench scenes)
MAX_SLOTS = 512  # slots a store keeps (50 blocks x 2 branches x a few head groups)
MEMORY_SHARE = 0.05  # of a GPU's memory the kept plans may hold: H3's 50 blocks at 10 s and cfg 1 on an 80 GB GPU
OTHER_DEVICE_BYTES = 2 << 30  # the budget on a device that is not a GPU
PLAN_FIELDS = ("tiling", "reblock_layout", "topk_ratio", "sparse_scope", "block_size", "routing_scores", "kernel",
               "precision")


@dataclass(frozen=True)
class Estimate:
    """The slots the kept plans of one shape fill over a run (`plan_reuse="auto"`): blocks x branches x groups.

    Attributes:
        blocks: the model's blocks that run sparse at this shape (not in dense_layers).
        branches: the cond/uncond branches a step runs as separate calls.
        groups: the head groups of a block call (KJNodes' ``minimax_head_chunks``).
        note: why `branches` is what it is, where that is not what the run has shown yet ("" otherwise).
    """

    blocks: int
    branches: int
    groups: int
    note: str = ""

    @property
    def slots(self) -> int:
        """Plans kept at once for this shape."""
        return self.blocks * self.branches * self.groups

    def __str__(self) -> str:
        def count(n: int, what: str) -> str:
            return f"{n} {what}" + ("" if n == 1 else "s" if not what.endswith("ch") else "es")
        return (f"{count(self.blocks, 'sparse block')} x {count(self.branches, 'branch')}{self.note} x "
                f"{count(self.groups, 'head group')}")


def plan_facts(q: torch.Tensor, config: SparseConfig, layout_signature: Hashable) -> tuple:
    """What a kept plan must share with a step to be reused: q's shape, dtype and device, the layout and
    the settings the tiling and routing depend on."""
    return (tuple(q.shape), q.dtype, str(q.device), layout_signature,
            tuple(getattr(config, name) for name in PLAN_FIELDS))


@dataclass
class Kept:
    """A plan kept from an evaluated step: its tiling and routing, and the means it was routed on."""

    facts: tuple
    tiling: Tiling
    q2k_idx: torch.Tensor
    q2k_num: torch.Tensor
    q_ref: torch.Tensor
    k_ref: torch.Tensor
    last_drift: torch.Tensor  # drift at the latest step that used it (0 at the build), on the device


def memory_budget(device: torch.device) -> int:
    """Bytes the kept plans of one store may hold on `device`: `MEMORY_SHARE` of a GPU's total memory
    (not its free memory, which changes from run to run), else `OTHER_DEVICE_BYTES`."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * MEMORY_SHARE)
    return OTHER_DEVICE_BYTES


def budget_name(device: torch.device, budget_bytes: int | None) -> str:
    """Where a store's budget on `device` comes from, as its notices say it."""
    if budget_bytes is not None:
        return "the store's own budget"
    return f"{MEMORY_SHARE:.0%} of the GPU's memory" if device.type == "cuda" else "the budget off a GPU"


def held_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind `tensors` (a permutation shared by Q and K counts once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def drift(q_mean: torch.Tensor, k_mean: torch.Tensor, q_ref: torch.Tensor, k_ref: torch.Tensor,
          span: tuple[int, int]) -> torch.Tensor:
    """Max over (batch, head, Q or K) of ||mean - ref|| / ||ref|| over blocks [lo, hi), fp32 scalar tensor.

    Args:
        q_mean, k_mean: block means [B, H, J, D] of this step on the kept tiling.
        q_ref, k_ref: the means the kept routing was chosen on (kept in bf16).
        span: the sparse blocks [lo, hi) (`kernels.plan.group_span`).
    Returns:
        The drift, a 0-dim fp32 tensor on the means' device (never read on the host here).
    """
    lo, hi = span
    worst = []
    for mean, ref in ((q_mean, q_ref), (k_mean, k_ref)):
        m, r = mean[:, :, lo:hi].float(), ref[:, :, lo:hi].float()
        worst.append(((m - r).flatten(2).norm(dim=-1) / r.flatten(2).norm(dim=-1).clamp_min(1e-12)).amax())
    return torch.stack(worst).amax()


class PlanSlot:
    """The plan of one (branch, block, shape, head group) between its evaluated steps (see the module)."""

    def __init__(self, store: PlanStore):
        self.store = store
        self.kept: Kept | None = None
        self.bytes = 0  # what `kept` holds, as the store accounts it
        self.device = ""  # where it holds it
        self.refused = False  # the latest fresh plan was not kept: the memory budget was spent
        self.size = 0  # bytes the latest fresh plan holds, kept or not (what `PlanStore.decide` measures)
        self.verdict: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # rebuild at the next step?
        self.host: torch.Tensor | None = None  # pinned buffer the verdict is copied into (CUDA)
        self.rate: torch.Tensor | None = None  # drift per unit gap between the latest two evaluated steps, on the device
        self.sigma: float | None = None  # sigma of the step being planned (`at`)
        self.next_sigma: float | None = None  # the schedule's next sigma after it
        self.last_sigma: float | None = None  # sigma of this slot's latest evaluated step

    def at(self, sigma: float | None, next_sigma: float | None) -> None:
        """Say the sigma of the step about to be planned and the schedule's next one (None: unknown; the
        check then counts steps)."""
        self.sigma, self.next_sigma = sigma, next_sigma

    def gaps(self) -> tuple[float, float]:
        """(gap from this slot's latest evaluated step to this one, gap from this one to the next): in sigma
        where all three sigmas are known and fall, else one step each. Gaps in steps and in sigma do not mix
        in ComfyUI: its model calls carry sigmas always or never."""
        prev, now, nxt = self.last_sigma, self.sigma, self.next_sigma
        if prev is None or now is None or nxt is None or not prev > now > nxt:
            return 1.0, 1.0
        return prev - now, now - nxt

    def reusable(self, facts: tuple) -> Kept | None:
        """The kept plan when this step may reuse it, else None (the store counts why). Waits only for a
        verdict the device has not reached although it was posted a model call ago (see the module)."""
        kept, reason = self.kept, None
        if kept is None:
            reason = "memory budget" if self.refused else "first"
        elif kept.facts != facts:
            reason = "shape or settings changed"
        elif self.verdict is not None:
            flag, event = self.verdict
            if event is not None:
                event.synchronize()  # returns at once unless the host ran a whole step ahead
            if bool(flag):
                reason = "statistics moved"
        self.store.count(reason or "reused")
        return kept if reason is None else None

    def keep(self, facts: tuple, tiling: Tiling, q2k_idx: torch.Tensor, q2k_num: torch.Tensor,
             q_mean: torch.Tensor, k_mean: torch.Tensor) -> None:
        """Keep a freshly built plan and the means it was routed on; the next step reuses it unless the
        last drift rate seen (before this rebuild) alone, over the next gap, passes the limit."""
        ref = torch.bfloat16  # the means kept: bf16 rounding (0.4%) is far below DRIFT_LIMIT
        size = (held_bytes(tiling.q_perm, tiling.k_perm, tiling.block_len, q2k_idx, q2k_num)
                + (q_mean.numel() + k_mean.numel()) * ref.itemsize)
        self.size = size
        self.refused = not self.store.admit(self, size, q_mean.device)
        self.verdict = None
        if self.refused:  # nothing is kept: the means are not copied either
            return
        self.kept = Kept(facts, tiling, q2k_idx, q2k_num, q_mean.to(ref), k_mean.to(ref),
                         q_mean.new_zeros((), dtype=torch.float32))
        if self.rate is not None and self.rate.device == q_mean.device:
            self.post(self.rate * self.gaps()[1] > self.store.drift_limit)
        self.last_sigma = self.sigma

    def check(self, q_mean: torch.Tensor, k_mean: torch.Tensor, span: tuple[int, int]) -> None:
        """Run the check on this step's means over the kept plan and post its verdict for the next step."""
        kept = self.kept
        now = drift(q_mean, k_mean, kept.q_ref, kept.k_ref, span)
        last_gap, next_gap = self.gaps()
        self.rate = (now - kept.last_drift) / last_gap
        kept.last_drift = now
        self.post((now + self.rate * next_gap) > self.store.drift_limit)
        self.last_sigma = self.sigma

    def post(self, rebuild: torch.Tensor) -> None:
        """Make `rebuild` (a bool tensor) the verdict the next step reads, copied without a host sync."""
        if rebuild.is_cuda:
            if self.host is None:
                self.host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.host.copy_(rebuild, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.verdict = (self.host, event)
        else:
            self.verdict = (rebuild, None)


class PlanStore:
    """The kept plans of one patched model's run: at most `MAX_SLOTS` slots, and how often each happened.

    Thread-safe (ComfyUI's multi-GPU sampling runs model calls in threads).

    Args:
        bound: slots kept at once.
        drift_limit: the predicted drift that forces a rebuild (`DRIFT_LIMIT`; the benchmark sweeps it).
        budget_bytes: bytes the kept plans may hold on each device; None: `memory_budget` of the device.
    """

    def __init__(self, bound: int = MAX_SLOTS, drift_limit: float = DRIFT_LIMIT, budget_bytes: int | None = None):
        if not drift_limit > 0:
            raise SparseAttentionError(f"PlanStore: drift_limit={drift_limit!r} must be > 0")
        if budget_bytes is not None and budget_bytes < 0:
            raise SparseAttentionError(f"PlanStore: budget_bytes={budget_bytes!r} must be >= 0 or None")
        self.bound = bound
        self.drift_limit = drift_limit
        self.budget_bytes = budget_bytes
        self.used: dict[str, int] = {}  # device -> bytes the kept plans hold there
        self.slots: OrderedDict[Hashable, PlanSlot] = OrderedDict()
        self.counts: dict[str, int] = {}
        self.notices = Notices()
        self.estimates: dict[Hashable, Estimate] = {}  # shape -> the slots auto counts for it, this run
        self.auto: dict[Hashable, bool] = {}  # shape -> auto's verdict this run: keep its plans?
        self.lock = threading.Lock()

    def slot(self, key: Hashable) -> PlanSlot:
        """The slot of `key` (branch, block, layout, head group), made on first use."""
        with self.lock:
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = PlanSlot(self)
                while len(self.slots) > self.bound:
                    self._forget(self.slots.popitem(last=False)[1])
            self.slots.move_to_end(key)
            return slot

    def admit(self, slot: PlanSlot, size: int, device: torch.device) -> bool:
        """Whether `slot` may keep a plan of `size` bytes in place of its own: within the budget. A plan
        refused drops the slot's old one too (it no longer matches the step); said once per run."""
        with self.lock:
            self._forget(slot)
            budget = self.budget(device)
            fits = self.used.get(str(device), 0) + size <= budget
            if fits:
                slot.bytes, slot.device = size, str(device)
                self.used[slot.device] = self.used.get(slot.device, 0) + size
        if not fits:
            self.notices.say(f"plan_reuse: the kept plans reached their memory budget ({budget / 2**30:.2f} GiB; "
                             f"{budget_name(device, self.budget_bytes)}), a plan here holds {size / 2**20:.0f} MiB: "
                             "the blocks past it plan afresh at every step (the report counts them)")
        return fits

    def budget(self, device: torch.device) -> int:
        """Bytes the kept plans may hold on `device` (`budget_bytes`, else `memory_budget`)."""
        return memory_budget(device) if self.budget_bytes is None else self.budget_bytes

    def expect(self, shape: Hashable, estimate: Estimate) -> None:
        """Say how many slots a run's kept plans of `shape` will fill (the first estimate of a run holds)."""
        with self.lock:
            self.estimates.setdefault(shape, estimate)

    def expects(self, shape: Hashable) -> bool:
        """Whether this run has an estimate for `shape` already."""
        return shape in self.estimates

    def verdict(self, shape: Hashable) -> bool | None:
        """auto's verdict for `shape` this run (True: keep its plans), None before its first plan."""
        return self.auto.get(shape)

    def decide(self, shape: Hashable, key: Hashable, slot: PlanSlot, device: torch.device, label: str) -> str | None:
        """auto's verdict for `shape`, once per run, on its first fresh plan (`slot`, kept under `key`): keep the
        shape's plans where that plan's bytes times the estimate's slots, plus what the store keeps for other
        shapes, fit the budget; else drop the slot and its count (the shape plans afresh, as with "off").

        Args:
            shape: the shape's key (the layout's signature).
            key: the slot's key in the store.
            slot: the slot the shape's first plan was built in (`PlanSlot.size` measured it).
            device: where the plans live (their budget).
            label: the shape as the notice names it.
        Returns:
            The notice to say once (which verdict and why, in bytes), or None where the verdict was made already
            (another thread's call of the same shape).
        """
        with self.lock:
            keep, notice = self.auto.get(shape), None
            if keep is None:
                estimate, budget = self.estimates.get(shape), self.budget(device)
                others = self.used.get(str(device), 0) - slot.bytes  # kept already for other shapes
                need = None if estimate is None else others + slot.size * estimate.slots
                keep = self.auto[shape] = need is not None and need <= budget
                notice = auto_notice(keep, label, estimate, slot.size, others, need, budget,
                                     budget_name(device, self.budget_bytes))
            if not keep and self.slots.get(key) is slot:
                self._forget(self.slots.pop(key))
                self.counts["first"] -= 1  # its one plan is counted as a plan of "off"'s: not at all
                if not self.counts["first"]:
                    del self.counts["first"]
        return notice

    def _forget(self, slot: PlanSlot) -> None:
        """Release `slot`'s plan from the store's accounting (a caller may still hold the slot)."""
        if slot.bytes:
            self.used[slot.device] -= slot.bytes
        slot.kept, slot.bytes = None, 0

    def count(self, what: str) -> None:
        """Count one planning decision: "reused", or why the plan was built afresh."""
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def summary(self) -> dict[str, int]:
        """Counts of this run: reused, built (all fresh plans) and rebuilds (fresh plans where a kept one
        existed), with the reasons."""
        with self.lock:
            counts = dict(self.counts)
        built = sum(n for why, n in counts.items() if why != "reused")
        fresh = counts.get("first", 0) + counts.get("memory budget", 0)  # nothing was kept to rebuild
        return {"reused": counts.get("reused", 0), "built": built, "rebuilds": built - fresh,
                **{f"built: {why}": n for why, n in sorted(counts.items()) if why != "reused"}}

    def drop_plans(self) -> None:
        """Drop every kept plan, keeping the counts (the run's schedule ended; its report still reads them)."""
        with self.lock:
            for slot in self.slots.values():
                self._forget(slot)
            self.slots.clear()

    def clear(self) -> None:
        """Drop every kept plan and count (the run ended); the budget's notice may be said again."""
        self.drop_plans()
        with self.lock:
            self.counts.clear()
            self.estimates.clear()
            self.auto.clear()
        self.notices.clear()


def auto_notice(keep: bool, label: str, estimate: Estimate | None, size: int, others: int, need: int | None,
                budget: int, budget_from: str) -> str:
    """What `PlanStore.decide` says of its verdict: which, and the bytes needed against the budget."""
    limit = f"the memory budget of {size_text(budget)} ({budget_from})"
    if estimate is None:
        return (f"plan_reuse auto: off for the {label} shape: the run's blocks, branches and head groups are not "
                "known here (a call outside a model call), so every block plans afresh at every step")
    held = f"{estimate} = {estimate.slots} plans of {size_text(size)}"
    if others:
        held += f", plus {size_text(others)} kept for other shapes"
    if keep:
        return (f"plan_reuse auto: on for the {label} shape: its kept plans need about {size_text(need)} ({held}), "
                f"within {limit}")
    return (f"plan_reuse auto: off for the {label} shape: its kept plans would need about {size_text(need)} "
            f"({held}), past {limit}: every block plans afresh at every step, the memory stays with sampling "
            "(plan_reuse on keeps the plans that fit)")


def size_text(n: int) -> str:
    """`n` bytes as the notices say them: GiB, MiB or KiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n / 1024:.1f} KiB"
