"""The Infra Agent: a goal-driven optimization loop on the dense feedback of ``flashinfra.feedback``.

A person writes a goals file (targets, acceptance criteria, guardrails, budgets); ``flashinfra agent run``
lets a language model behind any OpenAI-compatible chat-completions endpoint form hypotheses, edit code
in one git worktree per candidate and prove each candidate with checks, benchmarks, traces, runtime-event
summaries and A/B experiments. Candidate code runs in limited, network-less subprocesses. Candidates that
pass wait for a person: ``flashinfra agent review | approve | reject``. ``flashinfra mcp`` exposes the
same feedback tools to external coding agents over MCP.

Modules: ``campaign_goals`` (the campaign's goals file), ``paths`` (repository confinement and guardrails),
``sandbox`` (limited, network-less subprocesses), ``guard`` + ``worker`` (what runs inside them), ``worktree``
(git), ``evaluate`` (sandboxed runs and the gate a candidate must pass; its A/B verdict is
``flashinfra.feedback.stats.compare_blocks``), ``campaign`` (state on disk), ``chat_client``
(chat-completions client; ``flashinfra.llm`` is the offline engine), ``tools`` (the tool set), ``journal`` +
``report`` (JSONL journal, Markdown report), ``loop`` (the campaign), ``review`` (human approval),
``mcp_server`` and ``cli``. ``campaign_goals`` parses a campaign's file; the acceptance criteria in it are
evaluated by ``flashinfra.feedback.goals``, the same evaluator as ``flashinfra goals check``.
"""
