"""NVFP4 numerics and Triton kernels, imported as ``triage.kernels``.

Depends on torch and triton only; never on ``triage.trainers``.
"""
