"""The benchmark: pagedq measured against its baselines in one run.

Entry points: ``pagedq bench`` (pagedq.bench.command) and ``run_bench(config, json_path,
plot_dir)`` (run.py) for code and tests. The README's benchmark section says what each figure
means and how it is measured.
"""
