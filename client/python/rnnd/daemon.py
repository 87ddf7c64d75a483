"""rnnd.Daemon: start an rnnd binary on free loopback ports (tests, examples, notebooks).

    with rnnd.Daemon(cell="lstm", layers=2, input_size=8, hidden_size=32) as d:
        c = d.client()

Keyword arguments become flags (``input_size=8`` -> ``--input-size 8``); ``listen=`` adds
addresses to the loopback one (``listen="unix:/tmp/rnnd.sock"``), all of them in ``addresses``.
The binary is ``binary``, else $RNND_BIN, else ``rnnd`` on PATH (a list is an argv prefix). The
daemon's output is kept in ``log`` (a list of lines) and echoed to ``echo`` (a file object) when
given.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from .client import Client


class Daemon:
    def __init__(self, binary=None, backend="cpu", state_dir=None, echo=None, ready_timeout=60.0,
                 **flags):
        self.binary = binary or os.environ.get("RNND_BIN") or shutil.which("rnnd")
        if not self.binary:
            raise FileNotFoundError("no rnnd binary: pass binary=, set RNND_BIN or put rnnd on PATH")
        self.backend = backend
        self._tmp = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rnnd-state-")
            state_dir = self._tmp.name
        self.state_dir = state_dir
        self.flags = flags
        self.echo = echo
        self.ready_timeout = ready_timeout
        self.proc = None
        self.target = None
        self.addresses = []  # every --listen address, as bound (target is the first)
        self.http = None
        self.log = []
        self._ready = threading.Event()

    def argv(self):
        prefix = list(self.binary) if isinstance(self.binary, (list, tuple)) else [self.binary]
        argv = prefix + ["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                "--backend", self.backend, "--state-dir", self.state_dir]
        for k, v in self.flags.items():
            if v is None or v is False:
                continue
            argv += ["--" + k.replace("_", "-"), str(v)]
        return argv

    def start(self):
        """Starts the daemon and waits until it is ready; a running one is left as it is, so
        that ``with Daemon(...).start() as d:`` starts one process, not two."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1)
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        deadline = time.monotonic() + self.ready_timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("rnnd did not become ready (%s):\n%s"
                                   % (" ".join(map(str, self.argv())), "".join(self.log[-40:])))
        return self

    def _drain(self):
        for line in self.proc.stdout:
            self.log.append(line)
            if self.echo is not None:
                self.echo.write(line)
            if not self._ready.is_set() and "rnnd ready" in line:
                for word in line.split():
                    if word.startswith("grpc="):
                        self.target = word[5:]
                    elif word.startswith("http="):
                        self.http = word[5:]
                    elif word.startswith("listen="):
                        self.addresses = word[7:].split(",")
                if self.target:
                    self._ready.set()

    def client(self, **kw):
        return Client(self.target, **kw)

    def stop(self, sig=signal.SIGTERM, timeout=30.0):
        """Signals the daemon and waits for it; returns its exit status (kills it on timeout)."""
        rc = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
        elif self.proc is not None:
            rc = self.proc.returncode
        if self.proc is not None and self.proc.stdout is not None:
            self._drainer.join(5)
            if not self._drainer.is_alive():
                self.proc.stdout.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return rc

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
