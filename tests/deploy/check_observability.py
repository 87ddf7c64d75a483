#!/usr/bin/python3
"""check_observability.py: what an operator's tools read from rnnd, against a running rnnd.

    check_observability.py --rnnd build/server/rnnd --deploy deploy --version 0.1.0

Starts rnnd (CPU backend, loopback ports, a temporary state dir) with --log-format json, then:

- /metrics: rnnd_build_info{version,commit,backend,cuda} is the built version, a commit of this
  repository, backend cpu; the process_* metrics agree with what /proc says about the daemon's
  pid; every family has one HELP and one TYPE line.
- deploy/prometheus/rnnd-alerts.yml and deploy/grafana/rnnd-dashboard.json parse (PyYAML, json),
  are well-formed (alerts: expr, severity, summary; panels: ids, targets with expr; template
  variables defined), cover readiness, error rate, queue delay, limit rejections, checkpoint
  failures and model-version stall, and every metric their expressions name is one the daemon
  exports. Where promtool exists, `promtool check rules` also parses every expression.
- Logs: every stderr line of that run, of a failed start whose message holds quotes,
  backslashes, control characters and bytes that are not UTF-8, and of a bad flag value, is one
  JSON object (ts, level, msg) in strict UTF-8, the message intact; stdout keeps the plain ready
  line.

Prints one line per check and closes with "N passed, N failed"; exits 1 on any failure.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from checks import check, summary

try:
    import yaml
except ImportError:
    yaml = None


# ---------------------------------------------------------------------------------------------
# PromQL: the metric names an expression reads.

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
            "offset", "bool", "inf", "nan"}


def promql_metrics(expr):
    """The metric names in a PromQL expression (Grafana's $variables allowed)."""
    s = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'|`[^`]*`', '""', expr)  # strings
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)  # Grafana variables
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if m.group(0) in KEYWORDS or s[m.end():].lstrip().startswith("("):  # a function
            continue
        names.add(m.group(0))
    return names


def grafana_query_metrics(query):
    """Metric names in a Grafana template query: label_values(SELECTOR, label) or PromQL."""
    m = re.match(r"^\s*label_values\((.*),\s*\w+\s*\)\s*$", query)
    return promql_metrics(m.group(1) if m else query)


# ---------------------------------------------------------------------------------------------
# The daemon.

class Daemon:
    """rnnd on loopback ports with --log-format json; stdout and stderr read apart, as bytes."""

    def __init__(self, rnnd, state, args):
        self.argv = [rnnd, "--backend", "cpu", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                     "--state-dir", state, "--log-format", "json", "--input-size", "4",
                     "--hidden-size", "8"] + args
        self.spawned = time.time()
        self.p = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out, self.err, self.ready = [], [], threading.Event()
        self.readers = [threading.Thread(target=self._read, args=(self.p.stdout, self.out, True)),
                        threading.Thread(target=self._read, args=(self.p.stderr, self.err, False))]
        for t in self.readers:
            t.start()

    def _read(self, stream, lines, watch):
        for line in stream:
            lines.append(line)
            if watch and line.startswith(b"rnnd ready "):
                self.ready.set()

    def wait_ready(self, timeout=30):
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.p.poll() is not None or time.monotonic() > deadline:
                return None
        m = re.search(rb"^rnnd ready .*http=(\S+)", b"".join(self.out), re.M)
        return m.group(1).decode() if m else None

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        for t in self.readers:
            t.join(10)
        return self.p.returncode


def scrape(http):
    with urllib.request.urlopen("http://%s/metrics" % http, timeout=10) as r:
        return r.read().decode()


def parse_exposition(text):
    """({sample name: [(labels dict, value)]}, {family: {"HELP": n, "TYPE": n, "type": t}})."""
    samples, families = {}, {}
    for line in text.splitlines():
        m = re.match(r"^# (HELP|TYPE) (\S+) ?(.*)$", line)
        if m:
            f = families.setdefault(m.group(2), {"HELP": 0, "TYPE": 0})
            f[m.group(1)] += 1
            if m.group(1) == "TYPE":
                f["type"] = m.group(3)
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:\\.|[^"\\])*)"', m.group(3) or ""))
            samples.setdefault(m.group(1), []).append((labels, float(m.group(4))))
    return samples, families


def family_of(name, families):
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[:-len(suffix)] if name.endswith(suffix) else None
        if base and families.get(base, {}).get("type") == "histogram":
            return base
    return name


def proc_field(pid, path, key):
    with open("/proc/%d/%s" % (pid, path)) as f:
        for line in f:
            if line.startswith(key):
                return line[len(key):].split()
    return None


# ---------------------------------------------------------------------------------------------

def check_metrics(text, d, version, repo):
    samples, families = parse_exposition(text)
    fams = {family_of(n, families) for n in samples}
    bad = sorted(f for f in fams if families.get(f, {}).get("HELP") != 1 or
                 families.get(f, {}).get("TYPE") != 1)
    check(not bad, "/metrics: every family has one HELP and one TYPE line", bad)

    info = samples.get("rnnd_build_info", [])
    if check(len(info) == 1 and info[0][1] == 1, "/metrics: one rnnd_build_info sample, value 1",
             info):
        labels = info[0][0]
        check(set(labels) == {"version", "commit", "backend", "cuda"},
              "rnnd_build_info: labels version, commit, backend, cuda", labels)
        check(labels.get("version") == version, "rnnd_build_info: version is the project's (%s)"
              % version, labels)
        commit = labels.get("commit", "")
        in_repo = subprocess.run(["git", "-C", repo, "rev-parse", "--git-dir"],
                                 capture_output=True).returncode == 0
        known = re.fullmatch(r"[0-9a-f]{12}", commit) is not None and subprocess.run(
            ["git", "-C", repo, "cat-file", "-e", commit + "^{commit}"],
            capture_output=True).returncode == 0
        check(known if in_repo else commit == "unknown",
              "rnnd_build_info: commit is a commit of this repository", commit)
        check(labels.get("backend") == "cpu", "rnnd_build_info: backend cpu", labels)
        check(re.fullmatch(r"none|\d+\.\d+", labels.get("cuda", "")) is not None,
              "rnnd_build_info: cuda is a runtime version or none", labels)

    def one(name):
        v = samples.get(name, [])
        return v[0][1] if len(v) == 1 and not v[0][0] else None

    pid = d.p.pid
    fds = len(os.listdir("/proc/%d/fd" % pid))
    got = one("process_open_fds")
    check(got is not None and abs(got - fds) <= 3,
          "process_open_fds is the daemon's (%d in /proc)" % fds, got)
    soft = proc_field(pid, "limits", "Max open files")
    check(soft is not None and one("process_max_fds") == float(soft[0]),
          "process_max_fds is its soft RLIMIT_NOFILE", (one("process_max_fds"), soft))
    rss = float(proc_field(pid, "status", "VmRSS:")[0]) * 1024
    got = one("process_resident_memory_bytes")
    check(got is not None and rss / 2 < got < rss * 2,
          "process_resident_memory_bytes is about VmRSS (%.0f)" % rss, got)
    vsz = float(proc_field(pid, "status", "VmSize:")[0]) * 1024
    got = one("process_virtual_memory_bytes")
    check(got is not None and vsz / 2 < got < vsz * 2,
          "process_virtual_memory_bytes is about VmSize (%.0f)" % vsz, got)
    got = one("process_start_time_seconds")
    check(got is not None and abs(got - d.spawned) < 2.5,
          "process_start_time_seconds is when it was started (%.2f)" % d.spawned, got)
    got = one("process_cpu_seconds_total")
    check(got is not None and 0 < got <= (time.time() - d.spawned) * os.cpu_count() + 0.1,
          "process_cpu_seconds_total is positive and possible", got)
    check(families.get("process_cpu_seconds_total", {}).get("type") == "counter",
          "process_cpu_seconds_total is a counter")
    return set(samples)


def check_alerts(path, exported):
    with open(path) as f:
        doc = yaml.safe_load(f)
    rules = [r for g in (doc or {}).get("groups", []) for r in g.get("rules", [])]
    check(bool(rules), "rnnd-alerts.yml: has groups of rules")
    used = set()
    for r in rules:
        name = r.get("alert", "?")
        ann = r.get("annotations") or {}
        check(bool(r.get("alert")) and isinstance(r.get("expr"), str) and
              (r.get("labels") or {}).get("severity") in ("critical", "warning", "info") and
              ann.get("summary") and ann.get("description") and
              re.fullmatch(r"(\d+[smhd])?", str(r.get("for", ""))) is not None,
              "alert %s: expr, for, severity, summary and description" % name, r)
        names = promql_metrics(str(r.get("expr", "")))
        missing = sorted(names - exported)
        check(names and not missing, "alert %s: names only metrics rnnd exports" % name,
              "not exported: %s" % missing)
        used |= names
    # The situations an operator must hear about, by the metric that shows each one.
    want = {"readiness": "rnnd_ready", "error rate": "rnnd_requests_total",
            "queue delay": "rnnd_step_queue_delay_seconds_bucket",
            "limit rejections": "rnnd_limit_rejections_total",
            "checkpoint failures": "rnnd_checkpoints_total",
            "model-version stall": "rnnd_model_version"}
    for what, metric in want.items():
        check(metric in used, "rnnd-alerts.yml: alerts on %s (%s)" % (what, metric))
    if shutil.which("promtool"):
        r = subprocess.run(["promtool", "check", "rules", path], capture_output=True, text=True,
                           timeout=60)
        check(r.returncode == 0, "rnnd-alerts.yml: promtool check rules", r.stdout + r.stderr)
    else:
        print("skip  rnnd-alerts.yml: no promtool here to parse the expressions")
    return used


def check_dashboard(path, exported):
    with open(path) as f:
        dash = json.load(f)
    check(dash.get("title") and dash.get("uid") and isinstance(dash.get("schemaVersion"), int),
          "rnnd-dashboard.json: title, uid, schemaVersion")
    panels = dash.get("panels", [])
    panels = panels + [p for row in panels for p in row.get("panels", [])]
    ids = [p.get("id") for p in panels]
    check(len(ids) == len(set(ids)) and None not in ids, "rnnd-dashboard.json: unique panel ids")
    variables = {v.get("name"): v for v in (dash.get("templating") or {}).get("list", [])}
    exprs = []
    for p in panels:
        if p.get("type") == "row":
            continue
        t = p.get("targets") or []
        check(bool(t) and all(x.get("expr") and x.get("refId") for x in t),
              "panel %r: targets with expr and refId" % p.get("title"))
        exprs += [x.get("expr", "") for x in t]
        check(set(p.get("gridPos", {})) >= {"x", "y", "w", "h"}, "panel %r: gridPos"
              % p.get("title"))
    refs = set()
    for e in exprs + [json.dumps(p.get("datasource")) for p in panels]:
        refs |= set(re.findall(r"\$\{?(\w+)", e))
    missing = sorted(v for v in refs if not v.startswith("__") and v not in variables)
    check(not missing, "rnnd-dashboard.json: every $variable is defined", missing)
    for name, v in variables.items():
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            exprs.append(("label_values", q))
    used = set()
    for e in exprs:
        names = grafana_query_metrics(e[1]) if isinstance(e, tuple) else promql_metrics(e)
        check(names, "dashboard expression names a metric: %s" % (e,))
        used |= names
    missing = sorted(used - exported)
    check(not missing, "rnnd-dashboard.json: names only metrics rnnd exports (%d named)" % len(used),
          "not exported: %s" % missing)
    for m in ("rnnd_ready", "rnnd_build_info", "rnnd_requests_total",
              "rnnd_request_duration_seconds_bucket", "rnnd_step_queue_delay_seconds_bucket",
              "rnnd_limit_rejections_total", "rnnd_checkpoints_total", "rnnd_model_version",
              "process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        check(m in used, "rnnd-dashboard.json: shows %s" % m)


def check_json_lines(name, lines, want_msg=None):
    objs, bad = [], []
    for raw in lines:
        try:
            o = json.loads(raw.decode("utf-8", errors="strict"))
            ok = (isinstance(o, dict) and set(o) >= {"ts", "level", "msg"} and
                  re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", o["ts"]) and
                  o["level"] in ("debug", "info", "warn", "error") and isinstance(o["msg"], str))
            (objs if ok else bad).append(o if ok else raw)
        except ValueError as e:
            bad.append("%r: %s" % (raw, e))
    check(lines and not bad, "%s: every stderr line is a JSON object with ts, level, msg (%d)"
          % (name, len(lines)), bad[:3])
    if want_msg:
        check(any(want_msg in o["msg"] for o in objs), "%s: a line holds %r" % (name, want_msg),
              [o["msg"] for o in objs])
    return objs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rnnd", required=True)
    ap.add_argument("--deploy", required=True)
    ap.add_argument("--version", required=True, help="the project version CMake configured")
    a = ap.parse_args()
    deploy = os.path.abspath(a.deploy)
    repo = os.path.dirname(deploy)

    check(promql_metrics('sum by (instance, le) (rate(a_bucket{x="}[5m]"}[5m])) / '
                         'ignoring(resource) group_right b{resource=~"$r"} > 0.9 and on() '
                         'c offset 1h or vector(1e3) * histogram_quantile(0.9, d[$__rate_interval])')
          == {"a_bucket", "b", "c", "d"}, "self-check: metric names are read from PromQL")
    if not check(yaml is not None, "PyYAML is installed (python3-yaml; deploy/install-deps.sh)"):
        return 1

    with tempfile.TemporaryDirectory(prefix="rnnd-obs-") as state:
        d = Daemon(os.path.abspath(a.rnnd), state, [])
        http = d.wait_ready()
        exported = set()
        if check(http is not None, "rnnd starts with --log-format json and prints its ready line"):
            exported = check_metrics(scrape(http), d, a.version, repo)
        rc = d.stop()
        check(rc == 0, "rnnd stops cleanly on SIGTERM", rc)
        check(any(line.startswith(b"rnnd ready grpc=") for line in d.out),
              "stdout keeps the plain ready line", d.out)
        check_json_lines("json log", d.err, "rnnd ready grpc=")

    if exported:
        check_alerts(os.path.join(deploy, "prometheus", "rnnd-alerts.yml"), exported)
        check_dashboard(os.path.join(deploy, "grafana", "rnnd-dashboard.json"), exported)

    # A failed start whose error line repeats a path no log collector would expect.
    with tempfile.TemporaryDirectory(prefix="rnnd-obs-") as state:
        nasty = b'/nonexistent/q"b\\ t\tn\n\x01 \xc3\xa9 \xff.safetensors'
        d = Daemon(os.path.abspath(a.rnnd), state, [b"--weights", nasty])
        d.p.wait(30)
        rc = d.stop()
        check(rc == 1, "rnnd exits 1 when --weights does not exist", rc)
        want = nasty.decode("utf-8", errors="replace")
        check_json_lines("json log of a failed start", d.err, want)

    # A bad flag value after --log-format json: the one error line is JSON as well.
    with tempfile.TemporaryDirectory(prefix="rnnd-obs-") as state:
        d = Daemon(os.path.abspath(a.rnnd), state, ["--hidden-size", "0"])
        d.p.wait(30)
        check(d.stop() == 2, "rnnd exits 2 on a bad flag value")
        check_json_lines("json log of a bad flag", d.err, "hidden-size")

    return summary()


if __name__ == "__main__":
    sys.exit(main())
