"""``flashinfra mcp``: an MCP client (the official SDK) lists the feedback tools over stdio and calls them."""

import re
import sys
from pathlib import Path

import anyio

from tests.agent.fixture_repo import FIXES

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"list_files", "read_file", "search_code", "run_checks", "run_benchmarks", "gil_probe", "trace",
            "summarize_events", "ab_test"}


def test_mcp_lists_and_calls_tools(repo):
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    # An uncommitted edit in the working tree: the served tree is what the external agent is editing.
    path, old, new = FIXES["precision"]["correct"]
    (repo / path).write_text((repo / path).read_text().replace(old, new))
    params = StdioServerParameters(command=sys.executable, args=["-m", "flashinfra", "mcp", "--repo", str(repo),
                                   "--goals", str(repo / "goals/precision.toml")], cwd=str(ROOT),
                                   env={"PYTHONPATH": str(ROOT)})

    async def session():
        async with Client(params) as client:
            listed = await client.list_tools()
            names = {t.name for t in listed.tools}
            schema = next(t for t in listed.tools if t.name == "read_file").input_schema
            read = await client.call_tool("read_file", {"path": "engine/scan.py"})
            checks = await client.call_tool("run_checks", {"patterns": ["scan"]})
            escape = await client.call_tool("read_file", {"path": "../outside.txt"})
            ab = await client.call_tool("ab_test", {"names": ["kernel.rowsum"], "base": "HEAD"})
            return names, schema, read, checks, escape, ab

    names, schema, read, checks, escape, ab = anyio.run(session)
    assert EXPECTED <= names
    assert "path" in schema["properties"] and "path" in schema.get("required", [])
    assert not read.is_error and "carry = torch.zeros(D, dtype=torch.float32)" in read.content[0].text
    assert not checks.is_error and "PASS scan.long" in checks.content[0].text
    assert escape.is_error and "'..' is not allowed" in escape.content[0].text
    # The verdict itself is the A/B statistic's business (tested on its own); here: it ran, interleaved,
    # 2 subprocesses x 3 blocks per side, and reported a verdict with its noise floor.
    assert not ab.is_error, ab.content[0].text
    assert re.match(r"kernel\.rowsum: (no difference|faster|slower): .* noise floor [\d.]+%, p=.*n=6\+6\)$",
                    ab.content[0].text), ab.content[0].text
