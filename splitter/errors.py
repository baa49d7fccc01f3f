"""Errors raised by the splitter; messages name the offending node, module or file."""


class SplitError(ValueError):
    """The model cannot be split (no attention, an attention pattern the splitter cannot express,
    an export failure); the message names the node or module."""
