"""Model splitter: cut a model at its attention operators.

``split_model(model) -> SplitModel`` exports the model with ``torch.export`` over flattened tokens,
builds a ``networkx`` graph weighted by bytes per token, and takes a minimum cut at each attention.
"""
from lamina.splitter.errors import SplitError
from lamina.splitter.model import SplitModel, VerifyResult, split_model
from lamina.splitter.slices import SliceInfo

__all__ = ["split_model", "SplitModel", "SliceInfo", "SplitError", "VerifyResult"]
