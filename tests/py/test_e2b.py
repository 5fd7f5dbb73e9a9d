"""E2B's own Python SDK (PyPI `e2b`, pinned), unchanged, against husk's E2B API.

Run by tests/daemon.rs with pytest, with the SDK's own settings pointing at the
test daemon: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY (and HUSK_E2B_TEMPLATE).
Every sandbox here is a real microVM restored from a snapshot.
"""

import os
import time

import httpx
import pytest
from e2b import (
    AuthenticationException,
    ConnectionConfig,
    CommandExitException,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxQuery,
    TimeoutException,
)

TEMPLATE = os.environ.get("HUSK_E2B_TEMPLATE", "base")
# A guest on an emulating host is slow: generous request timeouts.
SLOW = 300


@pytest.fixture(scope="module")
def sbx():
    s = Sandbox.create(TEMPLATE, timeout=600, metadata={"suite": "e2b"}, request_timeout=SLOW)
    yield s
    s.kill()


def test_run_streams_output_as_user_in_home(sbx):
    seen = []
    r = sbx.commands.run(
        "echo hi; whoami; pwd; echo $HOME", on_stdout=seen.append, timeout=SLOW, request_timeout=SLOW
    )
    assert r.exit_code == 0
    assert r.stdout == "hi\nuser\n/home/user\n/home/user\n"
    assert "".join(seen) == r.stdout


def test_a_failing_command_raises_the_sdks_exception(sbx):
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo out; echo err >&2; exit 7", timeout=SLOW, request_timeout=SLOW)
    assert e.value.exit_code == 7
    assert e.value.stderr == "err\n"


def test_background_command_then_kill(sbx):
    h = sbx.commands.run("sleep 600", background=True, timeout=0, request_timeout=SLOW)
    assert h.pid > 0
    assert h.kill() is True
    with pytest.raises(CommandExitException):
        h.wait()


def test_a_command_that_times_out(sbx):
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 600", timeout=3, request_timeout=SLOW)


def test_a_terminal(sbx):
    got = []
    h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=SLOW)
    sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size; tty; exit\n")
    r = h.wait(on_pty=lambda d: got.append(d))
    out = b"".join(got).decode(errors="replace")
    assert r.exit_code == 0, out
    assert "30 100" in out, out
    assert "/dev/pts/" in out, out


def test_files(sbx):
    info = sbx.files.write("notes/hello.txt", "hello e2b\n", request_timeout=SLOW)
    assert info.path == "/home/user/notes/hello.txt"
    assert sbx.files.read("notes/hello.txt", request_timeout=SLOW) == "hello e2b\n"
    assert sbx.files.exists("/home/user/notes/hello.txt", request_timeout=SLOW)
    assert not sbx.files.exists("/home/user/nope", request_timeout=SLOW)
    assert sbx.files.make_dir("/home/user/made", request_timeout=SLOW) is True
    assert sbx.files.make_dir("/home/user/made", request_timeout=SLOW) is False
    entries = {e.name: e for e in sbx.files.list("/home/user", request_timeout=SLOW)}
    assert entries["made"].type == FileType.DIR
    assert entries["notes"].type == FileType.DIR
    moved = sbx.files.rename("notes/hello.txt", "/home/user/made/moved.txt", request_timeout=SLOW)
    assert moved.path == "/home/user/made/moved.txt"
    r = sbx.commands.run("cat /home/user/made/moved.txt", timeout=SLOW, request_timeout=SLOW)
    assert r.stdout == "hello e2b\n"
    sbx.files.remove("/home/user/made", request_timeout=SLOW)
    assert not sbx.files.exists("/home/user/made", request_timeout=SLOW)
    with pytest.raises(NotFoundException):
        sbx.files.read("/home/user/made/moved.txt", request_timeout=SLOW)


def test_watch_dir(sbx):
    sbx.files.make_dir("/home/user/watched", request_timeout=SLOW)
    w = sbx.files.watch_dir("/home/user/watched", request_timeout=SLOW)
    sbx.files.write("/home/user/watched/new.txt", "x", request_timeout=SLOW)
    names = set()
    deadline = time.time() + SLOW
    while "new.txt" not in names and time.time() < deadline:
        names |= {e.name for e in w.get_new_events()}
        time.sleep(1)
    w.stop()
    assert "new.txt" in names


def test_get_host_reaches_a_private_port_through_the_front_door(sbx):
    # The daemon's front door (husk serve --expose): E2B's host format.
    door, domain = os.environ["HUSK_FRONT_DOOR"], os.environ["HUSK_FRONT_DOMAIN"]
    assert sbx.get_host(3000) == f"3000-{sbx.sandbox_id}.{domain}"
    s = Sandbox.create(
        TEMPLATE, timeout=600, network={"allow_public_traffic": False}, request_timeout=SLOW
    )
    try:
        token = s.traffic_access_token
        assert token
        s.files.write("/tmp/www/index.html", "served from the sandbox\n", request_timeout=SLOW)
        s.commands.run(
            "busybox httpd -f -p 8000 -h /tmp/www", background=True, timeout=0, request_timeout=SLOW
        )
        host = s.get_host(8000)
        assert host == f"8000-{s.sandbox_id}.{domain}"
        with httpx.Client(base_url=f"http://{door}", timeout=SLOW) as http:
            deadline = time.time() + SLOW
            while True:
                r = http.get("/index.html", headers={"Host": host, "e2b-traffic-access-token": token})
                if r.status_code != 502 or time.time() > deadline:
                    break
                time.sleep(1)  # httpd is still starting
            assert r.status_code == 200, r.text
            assert r.text == "served from the sandbox\n"
            r = http.get("/index.html", headers={"Host": host})
            assert r.status_code == 403
            assert "e2b-traffic-access-token" in r.text
    finally:
        s.kill()


def test_list_timeout_pause_connect_kill():
    s = Sandbox.create(TEMPLATE, timeout=600, metadata={"suite": "lifecycle"}, request_timeout=SLOW)
    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"})).next_items()
    assert [x.sandbox_id for x in listed] == [s.sandbox_id]
    assert listed[0].metadata == {"suite": "lifecycle"}
    s.set_timeout(900)
    info = s.get_info()
    assert info.sandbox_id == s.sandbox_id
    assert s.pause() is not False
    paused = Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"})).next_items()
    assert paused[0].state.value == "paused"
    s2 = Sandbox.connect(s.sandbox_id, request_timeout=SLOW)
    r = s2.commands.run("echo back", timeout=SLOW, request_timeout=SLOW)
    assert r.stdout == "back\n"
    assert s2.kill() is True
    assert not s2.is_running()
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"})).next_items() == []


def test_bad_input():
    with pytest.raises(NotFoundException):
        Sandbox.connect("sb-000000000000")
    assert Sandbox.kill("sb-000000000000") is False
    with pytest.raises(AuthenticationException):
        Sandbox.create(TEMPLATE, api_key="e2b_wrongwrongwrongwrong")
    s = Sandbox.create(TEMPLATE, request_timeout=SLOW)
    s.kill()
    with pytest.raises(Exception) as e:
        s.commands.run("true", request_timeout=SLOW)
    assert "not" in str(e.value).lower()
    # A wrong access token: the SDK's own client, with a forged token.
    live = Sandbox.create(TEMPLATE, request_timeout=SLOW)
    try:
        forged = Sandbox(
            sandbox_id=live.sandbox_id,
            sandbox_domain=None,
            envd_version=live._envd_version,
            envd_access_token="0" * 32,
            traffic_access_token=None,
            connection_config=ConnectionConfig(
                extra_sandbox_headers={
                    "X-Access-Token": "0" * 32,
                    "E2b-Sandbox-Id": live.sandbox_id,
                    "E2b-Sandbox-Port": "49983",
                }
            ),
        )
        with pytest.raises(Exception) as e:
            forged.commands.run("true", request_timeout=SLOW)
        assert "token" in str(e.value).lower() or "unauthenticated" in str(e.value).lower()
    finally:
        live.kill()
