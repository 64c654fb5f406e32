"""``syncless bench``: ours against the plain path, measured side by side in one run.

Each benchmark module (``_syncs``, ``_cc``, ``_pp``) provides
``add_arguments(parser)`` and ``run(args, out_dir) -> BenchOutput``; results
are written as JSON, a markdown table and PNG plots by :mod:`._report`.
"""

__all__: list[str] = []
