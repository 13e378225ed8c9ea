"""Prometheus metrics served from each node's own registry."""
