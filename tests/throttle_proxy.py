"""A TCP proxy on loopback that makes a server slow on purpose: what it sends back to the
clients is held to ``bytes_per_second`` in all (every connection shares it, as one slow
link would), after a ``delay_seconds`` per reply. In front of a
real redis-server it is a remote node that answers but is slow (a busy or distant node),
for the tests and benchmark of cost-aware loads; lookups (small replies) stay fast.

    with ThrottleProxy(server.port, bytes_per_second=4 << 20) as proxy:
        url = proxy.url   # redis://127.0.0.1:<proxy port>

A thread per connection and direction; stopped (and every connection closed) on exit.
:class:`ProxyProcess` runs the same proxy in a process of its own, as a remote node would
be: its threads then take no share of the engine's GIL (the benchmark's in-process engine).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"
BUFFER = 64 << 10


class ThrottleProxy:
    def __init__(self, upstream_port: int, *, bytes_per_second: float,
                 delay_seconds: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.bytes_per_second = bytes_per_second
        self.delay_seconds = delay_seconds
        self._listener = socket.create_server((HOST, 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._pace = threading.Lock()
        self._free_at = 0.0  # when the shared link may send its next piece
        self._acceptor = threading.Thread(target=self._accept, name="throttle-accept", daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((HOST, self.upstream_port))
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True),
                             daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, slow: bool) -> None:
        try:
            while True:
                data = source.recv(BUFFER)
                if not data:
                    break
                if slow:
                    if self.delay_seconds:
                        time.sleep(self.delay_seconds)
                    for start in range(0, len(data), BUFFER // 4):
                        piece = data[start:start + BUFFER // 4]
                        self._wait_turn(len(piece))
                        target.sendall(piece)
                else:
                    target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _wait_turn(self, num_bytes: int) -> None:
        """Hold the caller until the shared link has sent what was queued before it."""
        with self._pace:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + num_bytes / self.bytes_per_second
            until = self._free_at
        time.sleep(max(until - time.monotonic(), 0.0))  # the throttle itself

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.close()
            except OSError:
                pass

    def __enter__(self) -> ThrottleProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class ProxyProcess:
    """:class:`ThrottleProxy` in a child process (``python -m tests.throttle_proxy``),
    stopped when its stdin closes; a context manager with the same ``port`` and ``url``."""

    def __init__(self, upstream_port: int, *, bytes_per_second: float,
                 delay_seconds: float = 0.0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.throttle_proxy", str(upstream_port),
             str(bytes_per_second), str(delay_seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=Path(__file__).resolve().parents[1])
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the throttle proxy did not start (it printed {line!r})")
        self.port = int(line)

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="a throttling TCP proxy until stdin closes")
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("bytes_per_second", type=float)
    parser.add_argument("delay_seconds", type=float, nargs="?", default=0.0)
    args = parser.parse_args()
    with ThrottleProxy(args.upstream_port, bytes_per_second=args.bytes_per_second,
                       delay_seconds=args.delay_seconds) as proxy:
        print(proxy.port, flush=True)
        sys.stdin.read()  # until the parent closes it (or dies)


if __name__ == "__main__":
    main()
