"""The shared decoding runtime (issue: runtime). Imports nothing from draftsmith.train."""
