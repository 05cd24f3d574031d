"""NVFP4 formats, recipes, reference quantizers and Triton kernels (``triage.kernels.nvfp4``)."""
