"""Benchmarks that print tables and save Markdown, JSON and a PNG plot."""
