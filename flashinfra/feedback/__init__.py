"""Dense feedback: correctness checks, microbenchmarks against measured ceilings, profiler traces,
runtime events, the GIL probe, A/B experiments between git revisions and goals files.

``registry`` is the contract other packages register with; the rest are tools built on it. Each package
registers its checks and benchmarks in its own ``checks.py`` (``flashinfra.kernels.checks``,
``flashinfra.kernels.kda.checks``, ``flashinfra.model.checks``, ...; the list is ``registry.PROVIDERS``);
``feedback.checks`` holds this package's own (the ceilings). ``stats`` is the one statistics module of
every A/B verdict (``ab``'s rounds, the Infra Agent's blocks). ``goals`` evaluates the acceptance criteria
of a goals file (``flashinfra goals check``, and the criteria of an Infra Agent campaign, whose file
``flashinfra.agent.campaign_goals`` parses).
"""
