"""TRL integration, imported as ``triage.trainers``."""
