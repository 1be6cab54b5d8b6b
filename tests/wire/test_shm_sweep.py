"""``shm.sweep_stale``: what a dead process of this uid left in the shm directory goes, files
(old named segments) and directories (doorbell channels, attach sockets) alike; what a live
process owns, or what does not match, stays."""

from __future__ import annotations

import os
import subprocess
import sys

from coliworker.client import doorbell
from coliworker.server import shm_socket
from coliworker.wire import shm


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_a_dead_processes_files_and_directories(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    seg_dead = tmp_path / f"coliworker-{dead}-{'a' * 16}"
    seg_live = tmp_path / f"coliworker-{live}-{'b' * 16}"
    bell_dead = tmp_path / f"coliworker-{dead}-{'c' * 16}.bell"
    other = tmp_path / "unrelated"
    for f in (seg_dead, seg_live, other):
        f.write_bytes(b"x")
    bell_dead.mkdir()
    (bell_dead / "fifo").write_bytes(b"")
    assert shm.sweep_stale(str(tmp_path)) == [seg_dead.name]
    assert doorbell.sweep_stale(str(tmp_path)) == [bell_dead.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([seg_live.name, other.name])


def test_attach_socket_sweep_takes_only_attach_directories(tmp_path):
    dead = _dead_pid()
    d = tmp_path / f"coliworker-attach-{dead}-{'d' * 16}"
    d.mkdir()
    (d / "socket").write_bytes(b"")
    seg = tmp_path / f"coliworker-{dead}-{'e' * 16}"
    seg.write_bytes(b"x")
    assert shm_socket.sweep_stale(str(tmp_path)) == [d.name]
    assert seg.exists()
