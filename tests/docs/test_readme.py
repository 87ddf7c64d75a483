"""The README's quick start runs as written against the daemon `make run` starts.

Starts rnnd as `make run` does (--config deploy/rnnd.conf), on the CPU backend, free loopback
ports and a scratch --state-dir, then runs the fenced block after each `<!-- readme-test: KIND -->`
marker of README.md: the sh block with bash (build/ replaced by this build tree, rnndctl's target
and the HTTP address pointed at this daemon) and the python block with this Python. The README's
addresses must be deploy/rnnd.conf's, so the snippets keep matching the daemon `make run` starts.

Environment (CTest sets it): RNND_BIN, RNND_BUILD_DIR, PYTHONPATH (the built rnnd package).
Exits 77 (skipped) when numpy or torch cannot be imported.
"""

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
README = os.path.join(ROOT, "README.md")
CONF = os.path.join(ROOT, "deploy", "rnnd.conf")


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def block(text, kind):
    """The fenced block right after the marker <!-- readme-test: kind -->."""
    m = re.search(r"<!-- readme-test: %s -->\n```[a-z]*\n(.*?)\n```" % kind, text, re.S)
    if m is None:
        fail("README.md has no fenced block right after <!-- readme-test: %s -->" % kind)
    return m.group(1) + "\n"


def conf_value(key):
    with open(CONF) as f:
        for line in f:
            words = line.split()
            if len(words) == 2 and words[0] == key:
                return words[1]
    fail("deploy/rnnd.conf has no '%s' line" % key)


def run(argv, env, cwd, what):
    p = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=120)
    print("--- %s (exit %d)\n%s" % (what, p.returncode, p.stdout))
    if p.returncode != 0:
        fail("the README's %s block failed as written (exit %d)" % (what, p.returncode))
    return p.stdout


def main():
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        print("SKIP: the Python snippet needs numpy and torch (%s)" % e)
        sys.exit(77)
    import rnnd

    with open(README) as f:
        text = f.read()
    sh, py = block(text, "sh"), block(text, "python")
    grpc, http = conf_value("listen"), conf_value("http")
    if grpc not in py:
        fail("the python block does not use make run's gRPC address %s (deploy/rnnd.conf)" % grpc)
    if http not in sh:
        fail("the sh block does not use make run's HTTP address %s (deploy/rnnd.conf)" % http)

    build = os.environ["RNND_BUILD_DIR"].rstrip("/") + "/"
    with tempfile.TemporaryDirectory(prefix="rnnd-readme-") as tmp, \
            rnnd.Daemon(binary=os.environ["RNND_BIN"], backend="cpu",
                        state_dir=os.path.join(tmp, "state"), config=CONF) as d:
        env = dict(os.environ, RNND_TARGET=d.target)
        sh_here = re.sub(r"(^|\s)build/", r"\1" + build, sh, flags=re.M).replace(http, d.http)
        out = run(["bash", "-e", "-c", sh_here], env, tmp, "sh")
        if "SERVING" not in out or "rnnd_env_steps_total 3" not in out:
            fail("the sh block ran but did not show SERVING and the three env steps")
        out = run([sys.executable, "-c", py.replace(grpc, d.target)], env, tmp, "python")
        if "model version 1" not in out:
            fail("the python block ran but did not apply one update")
    print("PASS: README quick start ran against rnnd --config deploy/rnnd.conf")


if __name__ == "__main__":
    main()
