"""Helpers for OrbitKV's tests, demo and benchmarks (no hub, no network)."""
