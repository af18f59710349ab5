"""attncomp's benchmarks: one module per benchmark (``kernels``, ``models``, ``generate``, ``distributed``,
``quality``), each with ``main(argv) -> int``, run by ``python -m attncomp bench NAME [args]``; results in
``benchmarks/results/<name>_<device>.json``; ``tables`` prints the README's tables from them."""
