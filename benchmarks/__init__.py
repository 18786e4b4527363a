"""Benchmarks for edgefl (issue 5); run each as `python -m benchmarks.<name>`."""
