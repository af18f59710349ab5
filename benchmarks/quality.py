"""Quality per wall-clock second of each attention policy: runs ``examples/train_quality.py``.

The training code lives in the example (a GPT trained once per policy on the Python standard
library's source, validation bits per byte against training time and steps); this entry point runs
its ``main`` with the same arguments, for ``python -m attncomp bench quality [args]`` and
``python benchmarks/quality.py [args]``. Results: ``benchmarks/results/quality_<device>.json``, a document of
``benchmarks/common.py`` (which the example imports for its device tag, versions, commit and writing).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import List, Optional

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_quality.py")
_NAME = "attncomp_examples_train_quality"


def _load():
    mod = sys.modules.get(_NAME)
    if mod is None:
        spec = importlib.util.spec_from_file_location(_NAME, _EXAMPLE)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {_EXAMPLE}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(_NAME, None)
            raise
    return mod


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``examples/train_quality.py`` with ``argv`` (default: this process's arguments)."""
    return _load().main(argv)


if __name__ == "__main__":
    sys.exit(main())
