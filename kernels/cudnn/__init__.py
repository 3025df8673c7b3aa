"""The cuDNN family: the attention's exact keys on cuDNN-frontend's block-sparse kernel, its tail on
Triton. cuDNN-frontend is optional: it is imported only when the kernel runs."""
