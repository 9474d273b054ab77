"""``flashinfra mcp``: an MCP client (the official SDK) lists the feedback tools over stdio and calls them."""

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
            # The edit does not touch rowsum: working tree vs HEAD is an A/A experiment for it.
            ab = await client.call_tool("ab_test", {"names": ["kernel.rowsum"], "base": "HEAD"})
            return names, schema, read, checks, escape, ab

    names, schema, read, checks, escape, ab = anyio.run(session)
    assert EXPECTED <= names
    assert "path" in schema["properties"] and "path" in schema.get("required", [])
    assert not read.is_error and "carry = torch.zeros(D, dtype=torch.float32)" in read.content[0].text
    assert not checks.is_error and "PASS scan.long" in checks.content[0].text
    assert escape.is_error and "'..' is not allowed" in escape.content[0].text
    assert not ab.is_error and ab.content[0].text.startswith("kernel.rowsum: no difference"), ab.content[0].text
    assert "n=6+6" in ab.content[0].text
