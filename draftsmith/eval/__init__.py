"""Evaluation drives draftsmith.runtime; it never re-implements decoding (issue: runtime)."""
