"""dsa: DeepSeek Sparse Attention (lightning indexer -> top-k -> sparse MLA) in portable Triton."""
from .backend import interpreter_on as _interpreter_on

if _interpreter_on():
    from ._interpreter import patch_interpreter as _patch

    _patch()

__version__ = "0.1.0"
