"""Benchmarks: `llmserve bench offline` (engine, no HTTP) and `llmserve bench serve` (HTTP)."""
