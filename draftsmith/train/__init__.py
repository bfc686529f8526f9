"""LightningModules and pure loss functions for drafter training (issue: drafters)."""
