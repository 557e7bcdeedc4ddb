"""Triton kernels for weights kept in a stored format (FP8 e4m3 blocks, GGUF Q8_0 / Q4_K blocks): decode the
stored bytes tile by tile and multiply in fp32, for a CUDA GPU (compiled) or, in tests, Triton's interpreter on
CPU tensors. Nothing here is imported at package import: Triton reads TRITON_INTERPRET when a kernel is defined,
so a holder imports its kernel module when the KernelPlan gives it the `triton` implementation
(platform/triton_runtime.py decides whether Triton can run on the weight's device; kernels/triton_linear.py is
the registry's check and the holders' entry)."""
