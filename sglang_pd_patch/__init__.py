"""Drop-in patch of sglang 0.5.23's prefill/decode disaggregation module.

Stdlib only; never imports sglang. Entry point: ``python -m sglang_pd_patch``.
"""

from .core import TOOL_VERSION as __version__

__all__ = ["__version__"]
