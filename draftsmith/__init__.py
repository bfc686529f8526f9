"""draftsmith: train the drafters that make LLM speculative decoding fast, and measure them.

`import draftsmith` is cheap and works without the optional dependencies; the heavy
modules (torch, transformers, Lightning) are imported by the subpackages that need them.
"""

__version__ = "0.1.0"


class DraftsmithError(ValueError):
    """A problem with the user's input: the CLI prints the message, no traceback, exit 2."""
