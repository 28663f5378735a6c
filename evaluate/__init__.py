"""Acceptance measurement, K selection, reports and plots, speed benchmarks."""
