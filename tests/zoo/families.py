"""The families of the sweep and how each tiny model is built: :mod:`attncomp.zoo` (``python -m attncomp report``
builds its models the same way)."""

from attncomp.zoo import *  # noqa: F401,F403
from attncomp.zoo import __all__  # noqa: F401
