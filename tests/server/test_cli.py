"""The command line: `coliworker serve` as a real process, info/stats/demo against it, config."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from coliworker.server import config as cfg
from coliworker.server.cli import build_parser, main


@pytest.fixture(scope="module")
def worker_process():
    env = dict(
        os.environ, COLIWORKER_BACKEND="auto", COLIWORKER_METRICS_PORT="0", COLIWORKER_PORT="0"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "coliworker", "serve"], env=env, stderr=subprocess.PIPE, text=True
    )
    lines = []
    deadline = time.monotonic() + 60
    address = None
    while time.monotonic() < deadline and address is None:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving on (\S+:\d+) \(backend (\w+)", line)
        if m:
            address = m.group(1)
    assert address, "worker did not start:\n" + "".join(lines)
    yield proc, address, "".join(lines)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_serve_auto_picks_and_logs_backend(worker_process):
    _, _, log = worker_process
    assert "backend auto:" in log  # says which backend and why


def test_info_stats_demo_against_the_process(worker_process, capsys):
    _, address, _ = worker_process
    assert main(["info", "--address", address]) == 0
    assert "device 0" in capsys.readouterr().out
    assert main(["demo", "--address", address, "--layers", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out
    assert main(["stats", "--address", address]) == 0
    assert main(["info", "--address", "127.0.0.1:1"]) == 1


def test_sigterm_drains_and_exits_zero(worker_process):
    proc, _, _ = worker_process
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_config_from_flags_and_environment():
    args = build_parser().parse_args(["serve", "--port", "6000", "--devices", "0,2"])
    env = {
        "COLIWORKER_PORT": "7000",
        "COLIWORKER_MEMORY_LIMIT": "1.5G",
        "COLIWORKER_METRICS_PORT": "0",
        "COLIWORKER_BACKEND": "numpy",
    }
    c = cfg.from_sources(args, env)
    assert c.port == 6000  # the flag wins over the variable
    assert c.devices == (0, 2)
    assert c.memory_limit == int(1.5 * 2**30)
    assert c.metrics_port is None  # 0 disables the endpoint
    assert c.backend == "numpy"


@pytest.mark.parametrize(
    "env,match",
    [
        ({"COLIWORKER_DEVICES": "0,0"}, "COLIWORKER_DEVICES: expected distinct device ids"),
        ({"COLIWORKER_MEMORY_LIMIT": "lots"}, "COLIWORKER_MEMORY_LIMIT: expected a size"),
        ({"COLIWORKER_BACKEND": "tpu"}, "backend: expected one of auto, numpy, cupy, got 'tpu'"),
        ({"COLIWORKER_PORT": "70000"}, "port: expected 0..65535, got 70000"),
    ],
)
def test_config_errors_name_the_source(env, match):
    with pytest.raises(ValueError, match=match):
        cfg.from_sources(None, env)


def test_readme_documents_every_setting():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    missing = [s.env for s in cfg.SETTINGS if s.env not in readme]
    assert not missing, f"README lacks {missing}; paste `python -m coliworker.server.config`"


def test_client_commands_take_a_token(tmp_path, capsys):
    from coliworker.server.app import build_server
    from coliworker.server.config import Config

    srv = build_server(
        Config(port=0, backend="numpy", metrics_port=None, tokens="ops:s3cret-token-0123456789")
    ).start()
    try:
        token = tmp_path / "token"
        token.write_text("s3cret-token-0123456789\n")
        assert main(["info", "--address", srv.address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert main(["info", "--address", srv.address, "--token-file", str(token)]) == 0
        assert main(["health", "--address", srv.address]) == 0  # health stays open
        assert (
            main(
                [
                    "demo",
                    "--address",
                    srv.address,
                    "--token-file",
                    str(token),
                    "--layers",
                    "1",
                    "--tokens",
                    "2",
                ]
            )
            == 0
        )
    finally:
        srv.stop(None)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coliworker", *args],
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,env,message",
    [
        (
            ["serve", "--log-level", "verbose"],
            {},
            "--log-level: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'VERBOSE'",
        ),
        (
            ["serve"],
            {"COLIWORKER_LOG_LEVEL": "chatty"},
            "COLIWORKER_LOG_LEVEL: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL",
        ),
        (["serve", "--port", "abc"], {}, "--port: expected an integer, got 'abc'"),
        (
            ["serve"],
            {"COLIWORKER_DRAIN_GRACE": "soon"},
            "COLIWORKER_DRAIN_GRACE: expected a number",
        ),
    ],
)
def test_settings_errors_are_one_plain_line(args, env, message, capsys):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "invalid literal" not in err, err


def test_a_misspelled_command_suggests_the_right_one(capsys):
    assert main(["sevre", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'sevre'; did you mean 'serve'?" in err
    assert "usage:" not in err


def test_a_busy_metrics_port_is_named_and_the_process_exits():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = run_cli("serve", "--port", "0", "--metrics-port", str(port))
    assert done.returncode == 1, done.stderr
    assert f"metrics endpoint 127.0.0.1:{port}: " in done.stderr
    assert "--metrics-port" in done.stderr and "Traceback" not in done.stderr


def test_client_commands_read_coliworker_address():
    from coliworker.server.app import build_server
    from coliworker.server.config import Config

    srv = build_server(Config(port=0, backend="numpy", metrics_port=None)).start()
    try:
        address = srv.address
        done = run_cli("info", env={"COLIWORKER_ADDRESS": address})
        assert done.returncode == 0, done.stderr
        assert f"at {address}" in done.stdout
        done = run_cli(
            "health", "--service", "coliworker.v1.Worker", env={"COLIWORKER_ADDRESS": address}
        )
        assert done.returncode == 0 and "SERVING" in done.stdout, done.stderr
        # The flag still wins over the variable.
        done = run_cli("info", "--address", address, env={"COLIWORKER_ADDRESS": "127.0.0.1:1"})
        assert done.returncode == 0, done.stderr
    finally:
        srv.stop(None)


def test_a_memory_limit_above_the_device_is_warned_about():
    from coliworker.server.backend import DeviceInfo
    from coliworker.server.memory import memory_limit_warnings

    devices = [DeviceInfo(0, "cpu", 23 << 30, 10 << 30), DeviceInfo(1, "cpu", 2000 << 30, 0)]
    (warning,) = memory_limit_warnings(1000 << 30, devices, "host")
    assert warning.startswith("--memory-limit 1000.0 GiB is more than device 0's host memory")
    assert "23.0 GiB" in warning
    assert memory_limit_warnings(0, devices, "host") == []  # no budget: free memory decides
    assert memory_limit_warnings(20 << 30, devices, "host") == []
