"""The `sm90` family: the exact keys on a warp-specialised Hopper kernel written in Gluon (TMA loader warp,
wgmma consumer warpgroup, mbarrier ring), the tail added by the Triton family's kernel. Hopper only; elsewhere
it is unavailable with the reason and the other families serve."""
