"""What the benches share: GLM-5.2's decode shapes, the raw echoes (gRPC and socket) that
sit beside a path to show what its transport alone costs, their clients, tensor uploads of
fresh random bytes, starting a worker process, and the machine a result was measured on.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

import grpc
import numpy as np

D, TOPK, N_EXPERTS = 6144, 8, 8
H, Q, R, V, K, D_OUT, T = 64, 192, 64, 256, 512, 6144, 4096

ECHO_UNARY = "/coliworker.bench.Echo/Unary"
ECHO_STREAM = "/coliworker.bench.Echo/Stream"

# The busy echo's work: memory-bound passes over 32 MB, in 1 MB steps, so that like a
# backend call it leaves the caches full of other data (that, more than the CPU time
# itself, is what slows the transport code that runs next).
_WORK = np.random.default_rng(1).random(4 << 20)
_STEP = 1 << 17


def echo_handlers() -> grpc.GenericRpcHandler:
    """Raw echo: the first 8 bytes of a request give the response size; no protobuf.

    Bytes 8..16, when present, ask the echo to work that many microseconds before it
    answers (NumPy passes over 32 MB, like a busy backend) and byte 16 = 1 asks it to sleep instead
    (like a backend waiting on its device); the first 8 bytes of the answer then hold the
    ns it spent, which the client subtracts as it subtracts backend time.
    """

    reply = echo_reply

    def unary(req: bytes, context) -> bytes:
        return reply(req)

    def stream(it, context):
        for req in it:
            yield reply(req)

    return grpc.method_handlers_generic_handler(
        "coliworker.bench.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )


def echo_reply(body: bytes) -> bytes:
    """What both echoes answer: the size asked for, after the work asked for."""
    size = int.from_bytes(body[:8], "little")
    work_us = int.from_bytes(body[8:16], "little") if len(body) >= 17 else 0
    if not work_us:
        return bytes(size)
    t0 = time.perf_counter_ns()
    if body[16] == 1:
        time.sleep(work_us / 1e6)
    else:
        i = 0
        while time.perf_counter_ns() - t0 < work_us * 1000:
            part = _WORK[i : i + _STEP]
            np.multiply(part, 1.0000001, out=part)
            i = (i + _STEP) % _WORK.size
    spent = time.perf_counter_ns() - t0
    return spent.to_bytes(8, "little") + bytes(max(size - 8, 0))


def socket_echo(spin_us: int) -> int:
    """A raw socket echo on a free loopback port: each frame (header, body, data) is read
    with the data plane's reader and answered by one REPLY frame of the size the body's first
    8 bytes ask for. Returns the port."""
    import socket
    import threading

    from coliworker.wire import frames

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)

    def conn(sock: socket.socket) -> None:
        fs = frames.FrameSocket(sock, spin_us)
        try:
            while True:
                head = fs.recv_header()
                body = bytes(fs.recv_bytes(head.body_bytes))
                fs.recv_array(head.data_bytes)
                out = echo_reply(body)
                fs.send(frames.frame(frames.REPLY, head.method, head.request_id, out))
        except (frames.Closed, OSError):
            fs.close()

    def accept() -> None:
        while True:
            sock, _ = lsock.accept()
            threading.Thread(target=conn, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return lsock.getsockname()[1]


def stats(ns: list[int]) -> dict[str, float]:
    a = np.asarray(ns, np.float64) / 1e6
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


class SocketEcho:
    """The raw socket echo's client: one frame out, one frame back, read as the socket
    session reads (polling first)."""

    def __init__(self, port: int) -> None:
        import socket

        from coliworker.client.socket_session import SPIN_US
        from coliworker.wire import frames

        self.frames = frames
        self.fs = frames.FrameSocket(socket.create_connection(("127.0.0.1", port)), SPIN_US)

    def measure(self, kind, req_bytes, resp_bytes, n, work_us=0, sleep=False):
        f = self.frames
        head = max(resp_bytes - f.HEADER_BYTES, 0).to_bytes(8, "little")
        if work_us:
            head += work_us.to_bytes(8, "little") + bytes([1 if sleep else 0])
        body_n = min(max(req_bytes - f.HEADER_BYTES, len(head)), 4096)
        body = head + bytes(body_n - len(head))
        data = np.zeros(max(req_bytes - f.HEADER_BYTES - body_n, 0), np.uint8)
        times = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            self.fs.send(f.frame(f.CALL, 10, i + 1, body, [data], data.nbytes))
            h = self.fs.recv_header()
            r = bytes(self.fs.recv_bytes(h.body_bytes))
            self.fs.recv_array(h.data_bytes)
            spent = int.from_bytes(r[:8], "little") if work_us else 0
            times.append(time.perf_counter_ns() - t0 - spent)
        return stats(times)


class Echo:
    def __init__(self, channel: grpc.Channel) -> None:
        self.unary = channel.unary_unary(ECHO_UNARY)
        self.stream = channel.stream_stream(ECHO_STREAM)

    def measure(
        self,
        kind: str,
        req_bytes: int,
        resp_bytes: int,
        n: int,
        work_us: int = 0,
        sleep: bool = False,
    ) -> dict[str, float]:
        """p50/p99 of echo round trips; with ``work_us`` the echo first works (or sleeps)
        that long and the time it spent is subtracted, as backend time is from a call."""
        head = resp_bytes.to_bytes(8, "little")
        if work_us:
            head += work_us.to_bytes(8, "little") + bytes([1 if sleep else 0])
        payload = head + bytes(max(req_bytes - len(head), 0))
        spent = (lambda r: int.from_bytes(r[:8], "little")) if work_us else (lambda r: 0)
        times = []
        if kind == "unary":
            for _ in range(n):
                t0 = time.perf_counter_ns()
                r = self.unary(payload)
                times.append(time.perf_counter_ns() - t0 - spent(r))
        else:
            import queue

            q: queue.SimpleQueue = queue.SimpleQueue()

            def gen():
                while (m := q.get()) is not None:
                    yield m

            it = self.stream(gen())
            for _ in range(n):
                t0 = time.perf_counter_ns()
                q.put(payload)
                r = next(it)
                times.append(time.perf_counter_ns() - t0 - spent(r))
            q.put(None)
            for _ in it:
                pass
        return stats(times)


def upload_expert(w, rng, inter: int):
    """One int4 expert (gate, up [inter, D], down [D, inter]) of fresh random bytes."""
    return (int4(w, rng, D, inter), int4(w, rng, D, inter), int4(w, rng, inter, D))


def int4(w, rng, i, o):
    """An int4 tensor [o, i] of fresh random bytes, uploaded."""
    q = rng.integers(0, 256, size=(o, (i + 1) // 2), dtype=np.uint8)
    s = (rng.random(o) * 0.02 + 0.005).astype(np.float32)
    return w.upload(q, s, fmt=2, in_features=i, out_features=o)


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = ""
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        lines = gpu.splitlines()
        gpu = f"{len(lines)} x {lines[0]}" if len(lines) > 1 else gpu  # one line per GPU
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "gpu": gpu or "none",
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "commit": commit(),
    }


def run_record(script: str) -> tuple[datetime.datetime, dict]:
    """When and where this run is, for a results file: (now in UTC, {date, machine,
    command}), the command being ``python <script> <this process's arguments>``."""
    date = datetime.datetime.now(datetime.timezone.utc)
    return date, {
        "date": date.isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python " + shlex.join([script, *sys.argv[1:]]),
    }


def write_json(out: str, name: str, doc: dict) -> str:
    """``doc`` as ``<out>/<name>.json``; returns ``<out>/<name>`` (the markdown goes beside)."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, name)
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=2)
    return stem


def write_md(stem: str, lines: list[str], show: bool = False) -> None:
    """``lines`` as ``<stem>.md`` (beside ``write_json``'s file), printed too with ``show``,
    then where both went."""
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    if show:
        print("\n".join(lines))
    print(f"wrote {stem}.json and .md")


def commit() -> str:
    """The commit a result comes from: COLIWORKER_COMMIT first (a run from an exported tree:
    the GPU machine's copy may carry an unrelated .git names the commit it was exported
    from), else git's HEAD, "+dirty" with uncommitted changes to tracked files."""
    if os.environ.get("COLIWORKER_COMMIT"):
        return os.environ["COLIWORKER_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def spawn(script: str, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """Start ``python script --serve *args`` (a bench's worker process); returns it and the
    fields of its ``READY ...`` line. The worker serves until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, script, "--serve", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().split() if proc.stdout else []
    if not line or line[0] != "READY":
        proc.kill()
        raise SystemExit(f"worker did not start: {line}")
    return proc, line[1:]


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """End a worker ``spawn`` started: close its stdin and wait for it."""
    if proc.stdin:
        proc.stdin.close()
    proc.wait(timeout)
