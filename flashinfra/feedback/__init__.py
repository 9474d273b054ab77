"""Dense feedback: correctness checks, microbenchmarks against measured ceilings, profiler traces,
runtime events, the GIL probe, A/B experiments between git revisions and goals files.

``registry`` is the contract other packages register with; the rest are tools built on it.
"""
