"""The official MCP Python SDK's client (PyPI `mcp`) against `husk mcp`.

Run by tests/daemon.rs with HUSK_BIN (the husk binary) and HUSK_HOST (the
test daemon's socket). Asserts as it goes; prints one JSON line at the end
with the sandbox it left behind on purpose (the session must destroy it).
"""

import asyncio
import json
import os
from contextlib import asynccontextmanager

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamablehttp_client
from mcp.shared.exceptions import McpError

TOOLS = {
    "create_sandbox",
    "run_command",
    "read_file",
    "write_file",
    "list_files",
    "destroy_sandbox",
    "start_command",
    "command_output",
    "send_input",
    "kill_command",
}


def text(result):
    return "".join(c.text for c in result.content if c.type == "text")


async def call(session, tool, args, error=False):
    result = await session.call_tool(tool, args)
    assert result.isError == error, f"{tool} {args}: isError={result.isError}: {text(result)}"
    return text(result)


@asynccontextmanager
async def over_stdio():
    params = StdioServerParameters(
        command=os.environ["HUSK_BIN"],
        args=["mcp", "--max-sandboxes", "1", "--max-command-s", "60"],
        env={"HUSK_HOST": os.environ["HUSK_HOST"], "PATH": os.environ.get("PATH", "")},
    )
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as s:
            yield s


@asynccontextmanager
async def over_http():
    # The daemon's own /mcp (its limits: husk serve --mcp-max-sandboxes 1).
    headers = {"Authorization": f"Bearer {os.environ['HUSK_TOKEN']}"}
    async with streamablehttp_client(
        os.environ["HUSK_MCP_URL"], headers=headers, timeout=300, sse_read_timeout=300
    ) as (read, write, _):
        async with ClientSession(read, write) as s:
            yield s


async def scenario(connect):
    async with connect() as s:
        if True:
            init = await s.initialize()
            assert init.serverInfo.name == "husk", init
            listed = await s.list_tools()
            names = {t.name for t in listed.tools}
            assert names == TOOLS, names
            for t in listed.tools:
                assert t.description and t.inputSchema["type"] == "object", t

            created = await call(s, "create_sandbox", {"template": "base"})
            sandbox = created.split()[2]
            assert sandbox.startswith("sb-"), created
            # Its limit: one sandbox at a time.
            refused = await call(s, "create_sandbox", {}, error=True)
            assert "limit" in refused, refused

            ran = await call(
                s, "run_command", {"sandbox": sandbox, "command": "echo hi; echo oops >&2; exit 3"}
            )
            assert ran.startswith("exit code 3\n"), ran
            assert "stdout:\nhi\n" in ran and "stderr:\noops\n" in ran, ran

            await call(s, "run_command", {"sandbox": sandbox, "command": "mkdir -p /tmp/mcp"})
            wrote = await call(
                s,
                "write_file",
                {"sandbox": sandbox, "path": "/tmp/mcp/hello.txt", "content": "hello mcp\n"},
            )
            assert "10 bytes" in wrote, wrote
            read = await call(s, "read_file", {"sandbox": sandbox, "path": "/tmp/mcp/hello.txt"})
            assert read == "hello mcp\n", read
            listing = await call(s, "list_files", {"sandbox": sandbox, "path": "/tmp/mcp"})
            assert listing == "f 10 hello.txt\n", listing
            by_shell = await call(
                s, "run_command", {"sandbox": sandbox, "command": "cat /tmp/mcp/hello.txt"}
            )
            assert "stdout:\nhello mcp\n" in by_shell, by_shell

            # A background command: it runs on between calls, takes input,
            # and its output is read from an offset.
            started = await call(
                s,
                "start_command",
                {"sandbox": sandbox, "command": "echo ready; read x; echo got $x; exit 4"},
            )
            assert started.startswith("started pid "), started
            pid = int(started.split()[2].rstrip(";"))
            ready = await call(s, "command_output", {"sandbox": sandbox, "pid": pid})
            for _ in range(300):
                if "ready" in ready:
                    break
                await asyncio.sleep(1)
                ready = await call(s, "command_output", {"sandbox": sandbox, "pid": pid})
            assert "still running" in ready and "ready\n" in ready, ready
            offset = int(ready.rsplit("next offset: ", 1)[1])
            await call(
                s, "send_input", {"sandbox": sandbox, "pid": pid, "input": "hi\n", "close": True}
            )
            rest = await call(
                s, "command_output", {"sandbox": sandbox, "pid": pid, "offset": offset}
            )
            for _ in range(300):
                if "exited" in rest:
                    break
                await asyncio.sleep(1)
                rest = await call(
                    s, "command_output", {"sandbox": sandbox, "pid": pid, "offset": offset}
                )
            assert "exited with code 4" in rest and "got hi\n" in rest, rest
            assert "ready" not in rest, rest
            sleeper = await call(s, "start_command", {"sandbox": sandbox, "command": "sleep 600"})
            spid = int(sleeper.split()[2].rstrip(";"))
            killed = await call(
                s, "kill_command", {"sandbox": sandbox, "pid": spid, "signal": "KILL"}
            )
            assert "sent KILL" in killed, killed

            # Refusals an agent can act on.
            timed_out = await call(
                s,
                "run_command",
                {"sandbox": sandbox, "command": "sleep 600", "timeout_s": 3},
                error=True,
            )
            assert "timed out after 3 s" in timed_out, timed_out
            too_long = await call(
                s,
                "run_command",
                {"sandbox": sandbox, "command": "true", "timeout_s": 3600},
                error=True,
            )
            assert "timeout_s must be 1-60" in too_long, too_long
            missing = await call(
                s, "read_file", {"sandbox": sandbox, "path": "/no/such/file"}, error=True
            )
            assert "/no/such/file" in missing, missing
            relative = await call(
                s, "read_file", {"sandbox": sandbox, "path": "etc/passwd"}, error=True
            )
            assert "not absolute" in relative, relative
            others = await call(
                s, "run_command", {"sandbox": "sb-someone-else", "command": "id"}, error=True
            )
            assert "not created by this MCP client" in others, others
            no_args = await call(s, "run_command", {"sandbox": sandbox}, error=True)
            assert "`command`" in no_args, no_args
            try:
                await s.call_tool("format_disk", {})
                raise AssertionError("an unknown tool was accepted")
            except McpError as e:
                assert "format_disk" in str(e), e

            destroyed = await call(s, "destroy_sandbox", {"sandbox": sandbox})
            assert sandbox in destroyed, destroyed
            gone = await call(
                s, "run_command", {"sandbox": sandbox, "command": "true"}, error=True
            )
            assert "not created by this MCP client" in gone, gone

            # One left behind: the session destroys it when the client goes.
            created = await call(s, "create_sandbox", {})
            left = created.split()[2]
            await s.send_ping()
    return {"left": left, "destroyed": sandbox}


async def main():
    print(json.dumps({"stdio": await scenario(over_stdio), "http": await scenario(over_http)}))


asyncio.run(main())
