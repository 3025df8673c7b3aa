"""The FlashAttention-4 family (the optional `flash-attn-4` package, `flash_attn.cute`): a dense kernel
the measured dense choice may run (family.py declares it). Nothing here imports the package: it is
imported when the kernel is first called."""
