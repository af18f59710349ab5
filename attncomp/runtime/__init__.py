"""Runtime: backend dispatch, the on-disk kernel cache and autotune store, and the AOT package format."""
