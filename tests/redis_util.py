"""A real redis-server for the tests (Debian's, started on loopback; a test fails when it is
missing): test_redis_tier.py and test_serve_speech.py start theirs with it."""
import shutil
import socket
import subprocess
import time

import pytest
import redis


class Server:
    """A redis-server on a free loopback port, killable and restartable on that port. The
    port is free when chosen, not when the server binds it: start() checks that the server
    answering is this one (INFO's process_id; probe: client options, e.g. TLS and a password)
    and picks new ports when this one exited (its bind failed)."""

    def __init__(self, tmp, *extra, conf=None, probe=None):
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            pytest.fail("redis-server not found: run ./run.sh setup (apt-get install redis-server)")
        self.tmp, self.extra, self.conf, self.probe = tmp, extra, conf, probe or {}
        for _ in range(3):
            self._pick_ports()
            if self.start(retry=True):
                return
        pytest.fail("redis-server: no free port after 3 tries")

    def _pick_ports(self):
        with socket.socket() as s, socket.socket() as s2:   # the port, and one for a cluster bus
            s.bind(("127.0.0.1", 0))
            s2.bind(("127.0.0.1", 0))
            self.port, self.bus = s.getsockname()[1], s2.getsockname()[1]
        self.cmd = [self.exe, *([str(self.conf)] if self.conf else []), "--port", str(self.port),
                    "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.tmp),
                    *(x.format(port=self.port, bus=self.bus) for x in self.extra)]
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self, retry=False) -> bool:
        """Start (or restart, on the same port) and wait until this process answers; False
        (retry=True) when it exited, as it does when another process took the port."""
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL)
        for _ in range(200):
            if self.proc.poll() is not None:
                if retry:
                    return False
                pytest.fail(f"redis-server exited ({self.proc.returncode}) on port {self.port}")
            try:
                c = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, **self.probe)
                try:
                    pid = int(c.info("server")["process_id"])
                finally:
                    c.close()
            except (redis.RedisError, OSError):
                time.sleep(0.02)
                continue
            if pid != self.proc.pid:         # another redis-server holds the port
                self.kill()
                if retry:
                    return False
                pytest.fail(f"port {self.port} is another redis-server's (pid {pid})")
            return True
        self.kill()
        pytest.fail(f"redis-server did not start on port {self.port}")

    def kill(self):
        self.proc.kill()
        self.proc.wait()
