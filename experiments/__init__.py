"""Runnable recipes: the DAPO-math ablation, the local small-model ablation, accelerate configs and
benchmarks. Imported as ``triage.experiments``; may depend on everything else."""
