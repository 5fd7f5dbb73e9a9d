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
    Secret,
    TimeoutException,
    Volume,
)

TEMPLATE = os.environ.get("HUSK_E2B_TEMPLATE", "base")
# A guest on an emulating host is slow: generous request timeouts, longer
# on a loaded host (the test sets HUSK_PATIENCE_S by the host's load).
SLOW = int(os.environ.get("HUSK_PATIENCE_S", "300"))


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


def test_stream_input_reaches_the_program_in_order(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True, timeout=0, request_timeout=SLOW)
    sbx.commands.stream_input(h.pid, ["line one\n", b"line two\n", "three"], timeout=SLOW)
    sbx.commands.close_stdin(h.pid, request_timeout=SLOW)
    r = h.wait()
    assert r.stdout == "line one\nline two\nthree"


def test_output_larger_than_the_guests_ring_arrives_whole(sbx):
    # 3 MiB through a 1 MiB ring: the program waits for the client.
    r = sbx.commands.run("yes 0123456789abcdef | head -c 3145728", timeout=SLOW, request_timeout=SLOW)
    assert len(r.stdout) == 3145728
    assert r.stdout.startswith("0123456789abcdef\n") and set(r.stdout) == set("0123456789abcdef\n")


def test_a_reconnect_gets_what_the_program_wrote_meanwhile(sbx):
    h = sbx.commands.run(
        "echo one; sleep 4; echo two; sleep 2; echo three",
        background=True,
        timeout=0,
        request_timeout=SLOW,
    )
    h.disconnect()
    # "two" is written while no client is connected; the ring keeps it.
    time.sleep(5)
    again = sbx.commands.connect(h.pid, timeout=SLOW)
    r = again.wait()
    assert r.exit_code == 0
    assert r.stdout.endswith("two\nthree\n"), r.stdout
    assert all(p.pid != h.pid for p in sbx.commands.list(request_timeout=SLOW))


def test_metrics_are_the_vms_own(sbx):
    idle = sbx.get_metrics(request_timeout=SLOW)[-1]
    h = sbx.commands.run("while :; do :; done", background=True, timeout=0, request_timeout=SLOW)
    try:
        time.sleep(1)
        busy = sbx.get_metrics(request_timeout=SLOW)[-1]
    finally:
        h.kill()
    assert idle.cpu_count >= 1
    # The guest's own count of its memory: less than the VM's size (the
    # kernel keeps some), more than nothing.
    assert 0 < idle.mem_used < idle.mem_total <= 4096 << 20
    assert 0.0 <= idle.cpu_used_pct <= 100.0
    # A guest spinning a vCPU: its VM's process uses a CPU.
    assert busy.cpu_used_pct > 20.0 / busy.cpu_count, (idle, busy)


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


def test_files_are_the_users_and_signed_urls_reach_them(sbx):
    # Written through the API for `user` (the default): the file and the
    # directories made for it are that user's, so its programs change them.
    sbx.files.write("/home/user/owned/deep/new.txt", "mine\n", request_timeout=SLOW)
    r = sbx.commands.run(
        "stat -c %U /home/user/owned /home/user/owned/deep /home/user/owned/deep/new.txt"
        " && echo more >> /home/user/owned/deep/new.txt && touch /home/user/owned/other && echo ok",
        timeout=SLOW,
        request_timeout=SLOW,
    )
    assert r.stdout == "user\nuser\nuser\nok\n"
    # Signed URLs: plain HTTP, no SDK headers, the signature is the key.
    up = sbx.upload_url("/home/user/signed.txt", use_signature_expiration=600)
    with httpx.Client(timeout=SLOW) as http:
        r = http.post(up, files={"file": ("signed.txt", b"via a signed url\n")})
        assert r.status_code == 200, r.text
        down = sbx.download_url("/home/user/signed.txt")
        r = http.get(down)
        assert r.status_code == 200, r.text
        assert r.text == "via a signed url\n"
        assert http.get(down.replace("signature=v1_", "signature=v1_A")).status_code == 401
        # A signature for reading does not write.
        assert http.post(down, files={"file": ("x", b"x")}).status_code == 401
        expired = sbx.download_url("/home/user/signed.txt", use_signature_expiration=-60)
        r = http.get(expired)
        assert r.status_code == 401 and "expired" in r.text


def test_file_metadata_are_the_files_extended_attributes(sbx):
    meta = {"owner": "alice", "build-id": "42"}
    written = sbx.files.write("meta.txt", "x", metadata={"Owner": "alice", "build-id": "42"})
    assert written.metadata == meta, written
    assert sbx.files.get_info("meta.txt").metadata == meta
    listed = {e.name: e.metadata for e in sbx.files.list(".")}
    assert listed["meta.txt"] == meta, listed
    # They travel with the file, and are the guest's user.e2b.* attributes.
    moved = sbx.files.rename("meta.txt", "moved.txt")
    assert moved.metadata == meta, moved
    plain = sbx.files.write("plain.txt", "y")
    assert plain.metadata is None and sbx.files.get_info("plain.txt").metadata is None
    relisted = {e.name: e.metadata for e in sbx.files.list(".")}
    assert relisted["plain.txt"] is None and relisted["moved.txt"] == meta, relisted
    # A new write is a new file: its metadata only.
    sbx.files.write("moved.txt", "z", metadata={"v": "2"})
    assert sbx.files.get_info("moved.txt").metadata == {"v": "2"}


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
    # husk's pause keeps memory: a file-system-only one is refused, and the
    # sandbox runs on.
    with pytest.raises(Exception, match="file-system-only"):
        s.pause(mode="filesystem", request_timeout=SLOW)
    assert s.is_running()
    # strict: the agent must answer first (it does).
    assert s.pause(strict=True, request_timeout=SLOW) is not False
    paused = Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"})).next_items()
    assert paused[0].state.value == "paused"
    # A resume by cold boot is refused the same way; the sandbox stays paused.
    with pytest.raises(Exception, match="file-system-only"):
        Sandbox.connect(s.sandbox_id, on_resume="reboot", request_timeout=SLOW)
    paused = Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"})).next_items()
    assert paused[0].state.value == "paused"
    s2 = Sandbox.connect(s.sandbox_id, request_timeout=SLOW)
    r = s2.commands.run("echo back", timeout=SLOW, request_timeout=SLOW)
    assert r.stdout == "back\n"
    assert s2.kill() is True
    assert not s2.is_running()
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"})).next_items() == []


def wait_for_state(sbx_id, suite, state):
    deadline = time.time() + SLOW
    while time.time() < deadline:
        listed = Sandbox.list(query=SandboxQuery(metadata={"suite": suite})).next_items()
        found = [x.state.value for x in listed if x.sandbox_id == sbx_id]
        if found == [state]:
            return
        time.sleep(1)
    raise AssertionError(f"{sbx_id} did not become {state}")


def test_lifecycle_pauses_at_the_timeout_and_traffic_or_connect_resumes():
    # on_timeout pause with auto_resume: the next request resumes it.
    s = Sandbox.create(
        TEMPLATE,
        timeout=2,
        metadata={"suite": "auto-resume"},
        lifecycle={"on_timeout": "pause", "auto_resume": True},
        request_timeout=SLOW,
    )
    try:
        wait_for_state(s.sandbox_id, "auto-resume", "paused")
        r = s.commands.run("echo resumed by traffic", timeout=SLOW, request_timeout=SLOW)
        assert r.stdout == "resumed by traffic\n"
    finally:
        s.kill()
    # Without its memory kept (husk hibernates it): connect wakes it, with
    # what it had.
    s = Sandbox.create(
        TEMPLATE,
        timeout=600,
        metadata={"suite": "hibernate"},
        lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}},
        request_timeout=SLOW,
    )
    try:
        s.files.write("/home/user/kept.txt", "kept\n", request_timeout=SLOW)
        # The timeout from now (a busy host's write may take more than a
        # short timeout from the create).
        s.set_timeout(2, request_timeout=SLOW)
        wait_for_state(s.sandbox_id, "hibernate", "paused")
        s2 = Sandbox.connect(s.sandbox_id, timeout=600, request_timeout=SLOW)
        r = s2.commands.run("cat /home/user/kept.txt", timeout=SLOW, request_timeout=SLOW)
        assert r.stdout == "kept\n"
    finally:
        s.kill()


def test_network_options_are_the_sandboxs_egress_policy():
    s = Sandbox.create(
        TEMPLATE,
        timeout=600,
        allow_internet_access=False,
        network={
            "allow_out": ["127.0.0.1"],
            "rules": {"api.example.com": [{"transform": {"headers": {"Authorization": "Bearer k"}}}]},
        },
        request_timeout=SLOW,
    )
    try:
        # Through the sandbox's egress proxy; both are refused before
        # anything leaves: one by the allowlist, the other (allowed by it)
        # as an address no sandbox reaches.
        ask = "printf 'GET http://%s/ HTTP/1.0\\r\\n\\r\\n' {} | busybox nc 127.0.0.1 3128"
        r = s.commands.run(
            ask.format("blocked.example") + "; echo; " + ask.format("127.0.0.1"),
            timeout=SLOW,
            request_timeout=SLOW,
        )
        assert "blocked.example:80 is not in this sandbox's allowlist" in r.stdout, r.stdout
        assert "127.0.0.1 is a loopback address" in r.stdout, r.stdout
        # The policy replaced while it runs (what is left out is cleared):
        # closed, 127.0.0.1 is refused by the allowlist now; opened again
        # for it, by the address check.
        s.update_network({"deny_out": ["0.0.0.0/0"]}, request_timeout=SLOW)
        r = s.commands.run(ask.format("127.0.0.1"), timeout=SLOW, request_timeout=SLOW)
        assert "127.0.0.1:80 is not in this sandbox's allowlist" in r.stdout, r.stdout
        s.update_network(
            {"deny_out": ["0.0.0.0/0"], "allow_out": ["127.0.0.1"]}, request_timeout=SLOW
        )
        r = s.commands.run(ask.format("127.0.0.1"), timeout=SLOW, request_timeout=SLOW)
        assert "127.0.0.1 is a loopback address" in r.stdout, r.stdout
        with pytest.raises(Exception) as e:
            s.update_network({"deny_out": ["10.0.0.0/8"]}, request_timeout=SLOW)
        assert "denyOut" in str(e.value)
    finally:
        s.kill()
    # What husk cannot enforce is refused, not dropped.
    with pytest.raises(Exception) as e:
        Sandbox.create(TEMPLATE, network={"deny_out": ["10.0.0.0/8"]}, request_timeout=SLOW)
    assert "denyOut" in str(e.value)
    with pytest.raises(Exception) as e:
        Sandbox.create(TEMPLATE, network={"dns_servers": ["1.1.1.1"]}, request_timeout=SLOW)
    assert "dnsServers" in str(e.value) and "resolves allowOut names on the host" in str(e.value)


def test_secrets_are_write_only_and_rules_name_them():
    # The request a rule's secret goes into is checked by tests/daemon.rs
    # (a_named_secret_is_resolved_per_request...), on its test network.
    name = f"tok-{os.getpid()}-{time.time_ns()}"
    info = Secret.create(name, "sk-never-shown", metadata={"team": "a"}, request_timeout=SLOW)
    assert (info.name, info.version, info.metadata) == (name, 1, {"team": "a"})
    assert Secret.get_info(name, request_timeout=SLOW).secret_id == info.secret_id
    updated = Secret.update(info.secret_id, "sk-next-never-shown", request_timeout=SLOW)
    assert updated.version == 2
    assert name in [s.name for s in Secret.list(request_timeout=SLOW).next_items()]
    with pytest.raises(Exception) as e:
        Secret.create(name, "again", request_timeout=SLOW)
    assert "exists" in str(e.value)
    rule = {"transform": {"headers": {"Authorization": f"Bearer {Secret.fill(name)}"}}}
    s = Sandbox.create(
        TEMPLATE,
        timeout=600,
        network={"allow_out": ["api.example.com"], "rules": {"api.example.com": [rule]}},
        request_timeout=SLOW,
    )
    try:
        r = s.commands.run("env; cat /etc/husk/* 2>/dev/null; true", timeout=SLOW, request_timeout=SLOW)
        assert "never-shown" not in r.stdout
    finally:
        s.kill()
    assert Secret.destroy(name, request_timeout=SLOW) is True
    assert Secret.destroy(name, request_timeout=SLOW) is False
    assert not Secret.exists(name, request_timeout=SLOW)
    # Workload identity tokens: refused with the reason, not dropped.
    with pytest.raises(Exception) as e:
        Sandbox.create(
            TEMPLATE,
            iam={"tokens": {"aws": Secret.iam_token(audience="sts", token_type="JWT-SVID")}},
            request_timeout=SLOW,
        )
    assert "workload identity" in str(e.value)


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


def test_a_volume_mounts_by_name_and_outlives_its_sandbox():
    vol = Volume.create("e2b-vol")
    assert vol.name == "e2b-vol" and vol.volume_id.startswith("vol-")
    s = Sandbox.create(TEMPLATE, volume_mounts={"/mnt/vol": vol}, request_timeout=SLOW)
    try:
        r = s.commands.run(
            "echo kept > /mnt/vol/note && cat /mnt/vol/note", timeout=SLOW, request_timeout=SLOW
        )
        assert r.stdout == "kept\n"
        with pytest.raises(Exception) as e:
            Volume.destroy(vol.volume_id)
        assert "mounted" in str(e.value)
    finally:
        s.kill()
    assert [v.name for v in Volume.list() if v.volume_id == vol.volume_id] == ["e2b-vol"]
    assert Volume.get_info("e2b-vol").volume_id == vol.volume_id
    assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False


def test_fork_copies_a_running_sandbox_with_its_files_and_programs():
    src = Sandbox.create(TEMPLATE, timeout=600, metadata={"suite": "fork"}, request_timeout=SLOW)
    try:
        src.files.write("/home/user/f", "src")
        # timeout=0: no command timeout. With the SDK's default (60 s) it
        # would be killed a minute after its start, in the source and in
        # the forks alike (they keep its deadline), before this test ends
        # on a slow host.
        src.commands.run(
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done",
            background=True,
            timeout=0,
            request_timeout=SLOW,
        )
        # The counter moved on within a minute (a loaded emulating host
        # runs a guest loop slowly); its process is listed either way.
        counting = (
            "for i in $(seq 60); do [ -s /tmp/count ] && break; sleep 1; done;"
            " a=$(cat /tmp/count); for i in $(seq 60); do sleep 1; b=$(cat /tmp/count);"
            " [ $b -gt $a ] && echo counting && exit 0; done; exit 1"
        )
        assert src.commands.run(counting, timeout=SLOW, request_timeout=SLOW).stdout == "counting\n"
        forks = src.fork(count=2, timeout=300, request_timeout=SLOW)
        assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
        try:
            ids = {f.sandbox_id for f in forks}
            assert len(ids) == 2 and src.sandbox_id not in ids
            for f in forks:
                assert f.files.read("/home/user/f") == "src"
                assert f.commands.run(counting, timeout=SLOW, request_timeout=SLOW).stdout == "counting\n"
            forks[0].files.write("/home/user/f", "one")
            assert forks[1].files.read("/home/user/f") == "src"
            assert src.files.read("/home/user/f") == "src"
            # The source runs on, its program too.
            assert src.commands.run(counting, timeout=SLOW, request_timeout=SLOW).stdout == "counting\n"
            listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "fork"})).next_items()
            assert {x.sandbox_id for x in listed} == ids | {src.sandbox_id}
        finally:
            for f in forks:
                f.kill()
        with pytest.raises(Exception) as e:
            httpx.post(
                f"{os.environ['E2B_API_URL']}/sandboxes/{src.sandbox_id}/fork",
                headers={"X-API-Key": os.environ["E2B_API_KEY"]},
                json={"count": 21},
            ).raise_for_status()
        assert "400" in str(e.value)
    finally:
        src.kill()
    with pytest.raises(NotFoundException):
        Sandbox.fork("sb-000000000000")


def test_a_snapshot_outlives_its_sandbox_and_starts_sandboxes():
    src = Sandbox.create(
        TEMPLATE, timeout=600, metadata={"suite": "snapshot"}, request_timeout=SLOW
    )
    try:
        src.files.write("/home/user/kept", "before", request_timeout=SLOW)
        snap = src.create_snapshot(request_timeout=SLOW)
        assert snap.snapshot_id and snap.names, snap
        # The source runs on after its snapshot.
        src.files.write("/home/user/kept", "after", request_timeout=SLOW)
        with pytest.raises(Exception) as e:
            src.create_snapshot(mode="filesystem", request_timeout=SLOW)
        assert "file-system-only" in str(e.value)
    finally:
        src.kill()
    listed = Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()
    assert [s.snapshot_id for s in listed] == [snap.snapshot_id], listed
    restored = Sandbox.create(snap.snapshot_id, timeout=600, request_timeout=SLOW)
    try:
        assert restored.files.read("/home/user/kept", request_timeout=SLOW) == "before"
        # Not deleted while a sandbox is restored from it.
        with pytest.raises(Exception) as e:
            Sandbox.delete_snapshot(snap.snapshot_id)
        assert "used by sandboxes" in str(e.value), e.value
    finally:
        restored.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    assert Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items() == []
    with pytest.raises(NotFoundException):
        Sandbox.create_snapshot("sb-000000000000")
