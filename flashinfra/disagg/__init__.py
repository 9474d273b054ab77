"""Disaggregated serving: describing, packing and checking a request's cache state between engines."""
