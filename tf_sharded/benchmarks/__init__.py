"""Benchmarks: every performance figure the project quotes comes from here."""
