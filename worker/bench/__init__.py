"""``pagedq bench``: the seed's claims measured against their baselines in one run.

Entry points: ``pagedq bench`` (cli.py) and ``run_bench(config, json_path, plot_dir)`` for code
and tests. See docs/bench.md for what each figure means and how it is measured.
"""
