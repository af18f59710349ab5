"""attncomp: a compiler for the attention in PyTorch models.

``attncomp.compile(model, policy=...)`` finds every attention site of an ``nn.Module``, rewrites each
to one ``attncomp::attention`` op under a sparsification policy, and runs it on the best backend.
"""

import importlib as _importlib
import sys as _sys

from . import policy as policies
from .policy import DFSS, ET, SPION, Dense, Drop, Hash, Policy, get_policy
from .spec import AttentionSpec
from . import ops, functional, spion

_sys.modules[__name__ + ".policies"] = policies

from ._version import __version__

__all__ = ["compile", "backend", "report", "export", "load", "functional", "policies", "get_policy",
           "AttentionSpec", "Policy", "Dense", "DFSS", "Hash", "Drop", "SPION", "ET"]


#: subpackages and modules reached as attributes (``attncomp.distributed.context_parallel_attention``)
#: after a plain ``import attncomp``, imported on first use: they pull in torch.distributed, torch.fx
#: and export machinery, matplotlib, which ``import attncomp`` alone should not cost
_LAZY_MODULES = ("api", "cli", "codegen", "distributed", "passes", "plot", "runtime")
_API_NAMES = ("compile", "backend", "report", "export", "load", "CompiledModule", "Report", "CaptureError")


def __getattr__(name):
    if name in _API_NAMES:
        from . import api

        return getattr(api, name)
    if name in _LAZY_MODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'attncomp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_API_NAMES) | set(_LAZY_MODULES))
