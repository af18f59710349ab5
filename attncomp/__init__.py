"""attncomp: a compiler for the attention in PyTorch models.

``attncomp.compile(model, policy=...)`` finds every attention site of an ``nn.Module``, rewrites each
to one ``attncomp::attention`` op under a sparsification policy, and runs it on the best backend.
"""

import sys as _sys

from . import policy as policies
from .policy import DFSS, ET, SPION, Dense, Drop, Hash, Policy, get_policy
from .spec import AttentionSpec
from . import ops, functional, spion

_sys.modules[__name__ + ".policies"] = policies

__version__ = "0.1.0"

__all__ = ["compile", "backend", "report", "export", "load", "functional", "policies", "get_policy",
           "AttentionSpec", "Policy", "Dense", "DFSS", "Hash", "Drop", "SPION", "ET"]


def __getattr__(name):
    # the API module imports torch.fx/export machinery: load it on first use
    if name in ("compile", "backend", "report", "export", "load", "CompiledModule", "Report", "CaptureError"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'attncomp' has no attribute {name!r}")
