#!/usr/bin/python3
"""check_deploy.py: checks deploy/ against the rnnd that was built.

    check_deploy.py --rnnd build/server/rnnd --deploy deploy [--start]

- The flags rnnd knows come from `rnnd --help` (the built binary), so a key or flag that the daemon
  does not have fails here, not on a production host.
- rnnd.conf.example and rnnd.conf: every key (set, or commented out as "# key value") is known,
  none is set twice, and the example mentions every key the daemon has.
- rnnd.service: restart on failure, a state directory that is --state-dir, graceful SIGTERM stop
  with a timeout, and every ExecStart flag known; `systemd-analyze verify` clean where it exists.
- Containerfile: a build stage and a final stage on an NVIDIA CUDA runtime image, sources that
  exist, every directory the top-level CMakeLists.txt adds copied in, CMD flags known, EXPOSE
  matching the ports, a HEALTHCHECK.
- k8s/*.yaml: every document parses (PyYAML) and has apiVersion/kind/metadata.name; the
  StatefulSet requests GPUs, has gRPC liveness/readiness probes on grpc.health.v1 at the gRPC
  port, Prometheus annotations on the HTTP port, a PersistentVolumeClaim template mounted at
  state-dir and the config from a ConfigMap whose rnnd.conf keys are known; the headless Service
  matches it; kustomization.yaml lists files that exist (and `kubectl kustomize` renders them,
  where kubectl exists; checks that need a tool this machine lacks print "skip").
- --start: also starts rnnd (CPU backend, loopback ports, a temporary state dir) with each config
  and each command line above, and expects the ready line and a clean SIGTERM exit, so the
  values are checked too.

Prints one line per check and closes with "N passed, N failed"; exits 1 on any failure.
"""

import argparse
import configparser
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from checks import check, summary

try:
    import yaml
except ImportError:
    yaml = None


# ---------------------------------------------------------------------------------------------
# What rnnd knows.

def known_flags(rnnd):
    """{flag: takes_value} from `rnnd --help`."""
    out = subprocess.run([rnnd, "--help"], capture_output=True, text=True, timeout=30)
    flags = {}
    for line in (out.stdout + out.stderr).splitlines():
        m = re.match(r"^\s+--([a-z][a-z0-9-]*)(\s+(\S+))?", line)
        if m:
            metavar = m.group(3) or ""
            # A metavar is upper case (N, FILE, HOST:PORT) or a choice list (gru|lstm).
            flags[m.group(1)] = bool(re.match(r"^([A-Z]|[a-z0-9]+\|)", metavar))
    return flags


def config_keys(flags):
    return {f for f in flags if f not in ("config", "help", "version")}


# ---------------------------------------------------------------------------------------------
# rnnd.conf syntax: "key value" lines, '#' comments (at the start or after a space), "quoted".

KEY_RE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


def parse_conf(text):
    """(set, commented): lists of (line number, key, value)."""
    set_, commented = [], []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            # A commented-out setting: "# key value", two words, the key in key syntax.
            body = line.lstrip("#").strip()
            words = body.split()
            if len(words) == 2 and KEY_RE.match(words[0]) and not words[1].endswith((".", ":")):
                commented.append((n, words[0], words[1]))
            continue
        line = re.split(r"\s#", line, maxsplit=1)[0].strip()
        try:
            words = shlex.split(line)
        except ValueError as e:
            words = [line, "<%s>" % e]
        set_.append((n, words[0], " ".join(words[1:])))
    return set_, commented


def check_conf(name, text, keys, want_all=False):
    set_, commented = parse_conf(text)
    check(len(set_) > 0, "%s: has settings" % name)
    unknown = ["line %d: %s" % (n, k) for n, k, _ in set_ + commented if k not in keys]
    check(not unknown, "%s: every key is known to rnnd --help" % name,
          "unknown: " + ", ".join(unknown))
    seen, dup = set(), []
    for n, k, _ in set_:
        if k in seen:
            dup.append("line %d: %s" % (n, k))
        seen.add(k)
    check(not dup, "%s: no key set twice" % name, ", ".join(dup))
    empty = ["line %d: %s" % (n, k) for n, k, v in set_ if not v]
    check(not empty, "%s: every key has a value" % name, ", ".join(empty))
    if want_all:
        mentioned = {k for _, k, _ in set_ + commented}
        missing = sorted(keys - mentioned)
        check(not missing, "%s: documents every key rnnd has" % name,
              "missing: " + ", ".join(missing))
    return {k: v for _, k, v in set_}


def check_argv(name, argv, flags):
    """Checks an rnnd command line (argv[0] is the program); returns {flag: value}."""
    vals, bad, k = {}, [], 1
    while k < len(argv):
        a = argv[k]
        if not a.startswith("--"):
            bad.append("stray argument %r" % a)
            k += 1
            continue
        f, eq, v = a[2:].partition("=")
        if f not in flags:
            bad.append("unknown flag --%s" % f)
            k += 1
            continue
        if flags[f] and not eq:
            if k + 1 >= len(argv):
                bad.append("--%s has no value" % f)
                break
            v = argv[k + 1]
            k += 1
        vals[f] = v
        k += 1
    check(not bad, "%s: every flag is known to rnnd --help" % name, "; ".join(bad))
    return vals


def port_of(hostport):
    try:
        return int(str(hostport).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Starting rnnd with a command line found in deploy/.

def start_rnnd(name, rnnd, args, timeout=45.0):
    """Runs rnnd args (with loopback ports, a temp state dir and the CPU backend forced, as one
    instance: the group flags are left out) until its ready line, then SIGTERM; checks the exit
    status is 0."""
    with tempfile.TemporaryDirectory(prefix="rnnd-deploy-") as state:
        forced = {"listen": "127.0.0.1:0", "http": "127.0.0.1:0", "data-listen": "auto",
                  "state-dir": state, "backend": "cpu"}
        dropped = {"world-size", "rank", "rendezvous"}
        argv, k = [rnnd], 0
        while k < len(args):
            f = args[k][2:].partition("=")[0]
            if f in forced or f in dropped:
                k += 1 if "=" in args[k] else 2
                continue
            argv.append(args[k])
            k += 1
        for f, v in forced.items():
            argv += ["--" + f, v]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=state)
        # A thread reads the output, so a buffered ready line is never missed.
        lines, ready = [], threading.Event()

        def drain():
            for line in p.stdout:
                lines.append(line)
                if "rnnd ready" in line:
                    ready.set()

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.1) and p.poll() is None and time.monotonic() < deadline:
            pass
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        rc = p.returncode
        t.join(5)
        p.stdout.close()
        ready = ready.is_set()
        log = "".join(lines[-15:]).rstrip().replace("\n", "\n      ")
        check(ready and rc == 0, "%s: rnnd starts with it and stops cleanly on SIGTERM" % name,
              "command: %s\n      ready=%s exit=%s; output:\n      %s"
              % (" ".join(argv), ready, rc, log))


# ---------------------------------------------------------------------------------------------
# systemd unit.

def check_unit(path, rnnd, flags, conf_values):
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str
    with open(path) as f:
        cp.read_file(f)
    check(cp.has_section("Unit") and cp.has_section("Service") and cp.has_section("Install"),
          "rnnd.service: [Unit], [Service] and [Install]")
    s = cp["Service"] if cp.has_section("Service") else {}
    check(s.get("Restart") in ("on-failure", "always", "on-abnormal"),
          "rnnd.service: restarts on failure", "Restart=%s" % s.get("Restart"))
    check(bool(s.get("StateDirectory")), "rnnd.service: has a StateDirectory")
    check(s.get("KillSignal", "SIGTERM") in ("SIGTERM", "15"), "rnnd.service: stops with SIGTERM")
    tmo = s.get("TimeoutStopSec", "")
    m = re.match(r"^(\d+)(s|sec)?$", tmo)
    drain = int(conf_values.get("drain-timeout-s", 10))
    check(bool(m) and int(m.group(1)) > drain,
          "rnnd.service: TimeoutStopSec exceeds the drain timeout (%d s)" % drain,
          "TimeoutStopSec=%s" % tmo)
    argv = shlex.split(s.get("ExecStart", "").lstrip("-@:+!"))
    check(bool(argv) and os.path.basename(argv[0]) == "rnnd", "rnnd.service: ExecStart runs rnnd",
          str(argv))
    vals = check_argv("rnnd.service ExecStart", argv, flags)
    want = "/var/lib/" + s.get("StateDirectory", "").split()[0] if s.get("StateDirectory") else None
    check(vals.get("state-dir") == want, "rnnd.service: --state-dir is the StateDirectory",
          "--state-dir %s, StateDirectory -> %s" % (vals.get("state-dir"), want))
    # systemd's own check, on a copy whose ExecStart is the rnnd that was built.
    if shutil.which("systemd-analyze") and argv:
        with tempfile.TemporaryDirectory(prefix="rnnd-unit-") as tmp:
            copy = os.path.join(tmp, "rnnd.service")
            with open(path) as f, open(copy, "w") as g:
                g.write(f.read().replace(argv[0], rnnd))
            r = subprocess.run(["systemd-analyze", "verify", copy], capture_output=True,
                               text=True, timeout=60)
            out = (r.stdout + r.stderr).strip()
            check(r.returncode == 0 and not out, "rnnd.service: systemd-analyze verify is clean",
                  out)
    else:
        print("skip  rnnd.service: no systemd-analyze here")
    return argv[1:]


# ---------------------------------------------------------------------------------------------
# Containerfile.

def containerfile_instructions(text):
    """[(INSTRUCTION, arguments)] with continuations joined and comments dropped."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        if cur and line.startswith("#"):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def check_containerfile(path, repo, flags):
    with open(path) as f:
        ins = containerfile_instructions(f.read())
    args = {}
    for i, a in ins:
        if i == "ARG" and "=" in a:
            k, v = a.split("=", 1)
            args[k.strip()] = v.strip().strip('"')

    def subst(s):
        return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), s)

    froms = [subst(a) for i, a in ins if i == "FROM"]
    check(len(froms) >= 2, "Containerfile: multi-stage (a build stage and a runtime stage)",
          str(froms))
    final = froms[-1].split()[0] if froms else ""
    check(re.match(r"^(docker\.io/)?nvidia/cuda:[0-9.]+-(cudnn-)?runtime-", final) is not None,
          "Containerfile: final stage is an NVIDIA CUDA runtime image", final)
    check(any("nvidia/cuda:" in f and "-devel-" in f for f in froms[:-1]),
          "Containerfile: builds on an NVIDIA CUDA devel image", str(froms))
    # COPY sources exist; every subdirectory CMake adds is copied.
    copied, missing = set(), []
    for i, a in ins:
        if i in ("COPY", "ADD") and "--from=" not in a:
            words = [w for w in shlex.split(a) if not w.startswith("--")]
            for src in words[:-1]:
                copied.add(os.path.normpath(src))
                if not os.path.exists(os.path.join(repo, src)):
                    missing.append(src)
    check(not missing, "Containerfile: every COPY source exists in the repository",
          ", ".join(missing))
    with open(os.path.join(repo, "CMakeLists.txt")) as f:
        subdirs = re.findall(r"add_subdirectory\(\s*([\w./-]+)", f.read())
    need = [] if "." in copied else [d for d in subdirs if d not in copied]
    check("CMakeLists.txt" in copied or "." in copied, "Containerfile: copies CMakeLists.txt")
    check(not need, "Containerfile: copies every directory CMakeLists.txt adds",
          "not copied: " + ", ".join(need))
    check(any(i == "RUN" and "bundle.sh" in a for i, a in ins) or
          any(i == "RUN" and "cmake --build" in a for i, a in ins),
          "Containerfile: builds rnnd from this repository")

    def exec_form(kind):
        vals = [a for i, a in ins if i == kind]
        if not vals:
            return None
        try:
            v = json.loads(vals[-1])
            return v if isinstance(v, list) else None
        except ValueError:
            return None

    entry, cmd = exec_form("ENTRYPOINT"), exec_form("CMD")
    check(bool(entry) and (entry[-1] == "rnnd" or entry[0].endswith("/rnnd")),
          "Containerfile: ENTRYPOINT runs rnnd (exec form)", str(entry))
    check(cmd is not None, "Containerfile: CMD in exec form")
    vals = check_argv("Containerfile CMD", ["rnnd"] + (cmd or []), flags)
    exposed = set()
    for i, a in ins:
        if i == "EXPOSE":
            exposed |= {int(p.split("/")[0]) for p in a.split()}
    ports = {port_of(vals.get("listen", "127.0.0.1:50051")),
             port_of(vals.get("http", "127.0.0.1:9090"))}
    if vals.get("data-listen", "auto") not in ("auto", "off"):
        ports.add(port_of(vals["data-listen"]))
    check(ports <= exposed, "Containerfile: EXPOSE covers the gRPC, HTTP and data ports",
          "ports %s, exposed %s" % (sorted(ports), sorted(exposed)))
    check(not vals.get("listen", "").startswith("127.") and
          not vals.get("http", "").startswith("127."),
          "Containerfile: listens beyond loopback", str(vals))
    check(any(i == "HEALTHCHECK" for i, _ in ins), "Containerfile: has a HEALTHCHECK")
    hc = [a for i, a in ins if i == "HEALTHCHECK"]
    check(bool(hc) and str(port_of(vals.get("listen", ":50051"))) in hc[0],
          "Containerfile: HEALTHCHECK asks the gRPC port", str(hc))
    return cmd or []


# ---------------------------------------------------------------------------------------------
# Kubernetes manifests.

def check_k8s(kdir, flags, keys):
    docs, files = [], sorted(f for f in os.listdir(kdir) if f.endswith((".yaml", ".yml")))
    check(bool(files), "k8s: has manifests")
    for f in files:
        try:
            with open(os.path.join(kdir, f)) as fh:
                ds = [d for d in yaml.safe_load_all(fh) if d is not None]
        except yaml.YAMLError as e:
            check(False, "k8s/%s: parses" % f, str(e))
            continue
        check(bool(ds), "k8s/%s: parses" % f)
        for d in ds:
            ok = isinstance(d, dict) and d.get("apiVersion") and d.get("kind") and (
                d.get("kind") == "Kustomization" or (d.get("metadata") or {}).get("name"))
            check(bool(ok), "k8s/%s: %s has apiVersion, kind and metadata.name"
                  % (f, isinstance(d, dict) and d.get("kind")))
            if ok:
                docs.append((f, d))

    def of_kind(kind):
        return [d for _, d in docs if d.get("kind") == kind]

    for f, d in docs:
        if d["kind"] == "Kustomization":
            missing = [r for r in d.get("resources", [])
                       if not os.path.exists(os.path.join(kdir, r))]
            check(not missing, "k8s/%s: every resource exists" % f, ", ".join(missing))
            if shutil.which("kubectl"):
                r = subprocess.run(["kubectl", "kustomize", kdir], capture_output=True,
                                   text=True, timeout=60)
                kinds = []
                if r.returncode == 0:
                    kinds = sorted(x.get("kind") for x in yaml.safe_load_all(r.stdout) if x)
                check(r.returncode == 0 and kinds == ["ConfigMap", "Service", "StatefulSet"],
                      "k8s/%s: kubectl kustomize renders the ConfigMap, Service and StatefulSet"
                      % f, (r.stderr.strip() or str(kinds)))
            else:
                print("skip  k8s/%s: no kubectl here to render it" % f)
            listed = set(d.get("resources", []))
            unlisted = [x for x, dd in docs if dd["kind"] != "Kustomization" and x not in listed]
            check(not unlisted, "k8s/%s: lists every manifest" % f,
                  ", ".join(sorted(set(unlisted))))

    sts_list = of_kind("StatefulSet")
    if not check(len(sts_list) == 1, "k8s: one StatefulSet"):
        return []
    sts = sts_list[0]
    spec = sts.get("spec", {})
    tpl = spec.get("template", {})
    pod = tpl.get("spec", {})
    labels = (tpl.get("metadata") or {}).get("labels") or {}
    sel = (spec.get("selector") or {}).get("matchLabels") or {}
    check(bool(sel) and all(labels.get(k) == v for k, v in sel.items()),
          "k8s StatefulSet: selector matches the pod labels", "%s vs %s" % (sel, labels))
    containers = pod.get("containers") or []
    c = next((x for x in containers if x.get("name") == "rnnd"),
             containers[0] if containers else {})
    check(bool(c.get("image")), "k8s StatefulSet: container has an image")
    argv = ["rnnd"] + [str(a) for a in (c.get("command") or [])[1:]] + [str(a) for a in
                                                                       c.get("args") or []]
    vals = check_argv("k8s StatefulSet args", argv, flags)
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
    check("grpc" in ports and "http" in ports, "k8s StatefulSet: named ports grpc and http",
          str(ports))
    res = c.get("resources") or {}
    gpu_lim = (res.get("limits") or {}).get("nvidia.com/gpu")
    gpu_req = (res.get("requests") or {}).get("nvidia.com/gpu")
    check(gpu_lim is not None and int(gpu_lim) >= 1 and (gpu_req is None or gpu_req == gpu_lim),
          "k8s StatefulSet: requests GPUs (nvidia.com/gpu limit, request equal if given)",
          "limits %s requests %s" % (gpu_lim, gpu_req))

    # Config from a ConfigMap, mounted where --config points.
    mounts = {m.get("name"): m for m in c.get("volumeMounts") or []}
    vols = {v.get("name"): v for v in pod.get("volumes") or []}
    conf = {}
    cfg = vals.get("config")
    cm_vol = next((n for n, v in vols.items() if "configMap" in v and n in mounts), None)
    if check(cfg is not None and cm_vol is not None and
             cfg.startswith(mounts[cm_vol]["mountPath"].rstrip("/") + "/"),
             "k8s StatefulSet: --config is a file of a mounted ConfigMap",
             "--config %s, configMap volume %s" % (cfg, cm_vol)):
        cm_name = vols[cm_vol]["configMap"].get("name")
        cms = [d for d in of_kind("ConfigMap") if d["metadata"]["name"] == cm_name]
        key = os.path.basename(cfg)
        if check(len(cms) == 1 and key in (cms[0].get("data") or {}),
                 "k8s ConfigMap %s: holds %s" % (cm_name, key)):
            text = cms[0]["data"][key]
            conf = check_conf("k8s ConfigMap %s/%s" % (cm_name, key), text, keys)
            conf["__text__"] = text
    eff = dict(conf)
    eff.update(vals)
    grpc_port, http_port = port_of(eff.get("listen", "127.0.0.1:50051")), port_of(
        eff.get("http", "127.0.0.1:9090"))
    check(grpc_port == ports.get("grpc") and http_port == ports.get("http"),
          "k8s StatefulSet: listen/http ports are the containerPorts",
          "listen %s http %s ports %s" % (eff.get("listen"), eff.get("http"), ports))
    # Socket regions' data connections: a fixed port other pods reach (learners on other hosts).
    data = str(eff.get("data-listen", "auto"))
    check(data in ("auto", "off") or port_of(data) == ports.get("data"),
          "k8s StatefulSet: data-listen's port is the containerPort named data",
          "data-listen %s ports %s" % (data, ports))
    check(not str(eff.get("listen", "127.")).startswith("127.") and
          not str(eff.get("http", "127.")).startswith("127."),
          "k8s: rnnd listens beyond loopback", "listen %s http %s"
          % (eff.get("listen"), eff.get("http")))

    # Probes: Kubernetes gRPC probes on grpc.health.v1 at the gRPC port.
    for probe in ("livenessProbe", "readinessProbe"):
        g = (c.get(probe) or {}).get("grpc") or {}
        check(g.get("port") == grpc_port and g.get("service", "") in ("", "rnnd.v1.Rnn"),
              "k8s StatefulSet: %s is a gRPC health probe on port %s" % (probe, grpc_port),
              str(c.get(probe)))
    sp = c.get("startupProbe")
    if sp is not None:
        check(((sp.get("grpc") or {}).get("port")) == grpc_port,
              "k8s StatefulSet: startupProbe on the gRPC port", str(sp))

    # Prometheus.
    ann = (tpl.get("metadata") or {}).get("annotations") or {}
    check(ann.get("prometheus.io/scrape") == "true" and
          str(ann.get("prometheus.io/port")) == str(http_port) and
          ann.get("prometheus.io/path", "/metrics") == "/metrics",
          "k8s StatefulSet: Prometheus scrape annotations on the HTTP port", str(ann))

    # State on a PersistentVolumeClaim template mounted at state-dir.
    vct = {(v.get("metadata") or {}).get("name"): v for v in spec.get("volumeClaimTemplates") or []}
    sdir = eff.get("state-dir")
    pvc = next((n for n in vct if n in mounts and mounts[n].get("mountPath") == sdir), None)
    check(sdir is not None and pvc is not None,
          "k8s StatefulSet: state-dir is a mounted PersistentVolumeClaim template",
          "state-dir %s, claims %s, mounts %s" % (sdir, list(vct), {n: m.get("mountPath")
                                                                  for n, m in mounts.items()}))
    if pvc:
        req = (((vct[pvc].get("spec") or {}).get("resources") or {}).get("requests") or {})
        check("storage" in req, "k8s StatefulSet: the claim requests storage", str(vct[pvc]))
    grace = pod.get("terminationGracePeriodSeconds", 30)
    drain = int(eff.get("drain-timeout-s", 10))
    check(int(grace) > drain, "k8s StatefulSet: terminationGracePeriodSeconds exceeds "
          "drain-timeout-s (%d)" % drain, "grace %s" % grace)

    # A group of pods (--world-size): one rank per replica, rank 0 met at pod 0's rendezvous
    # port, which the headless Service publishes before the pods are ready.
    world = int(eff.get("world-size", 1))
    rdv = str(eff.get("rendezvous", ""))
    if world > 1:
        check(world == int(spec.get("replicas", 1)) and str(eff.get("rank")) == "auto",
              "k8s StatefulSet: --world-size equals replicas and --rank is auto",
              "world-size %s replicas %s rank %s" % (world, spec.get("replicas"), eff.get("rank")))
        first = "%s-0.%s" % (sts["metadata"]["name"], spec.get("serviceName"))
        check(rdv.rpartition(":")[0] in (first, first + ".svc") or
              rdv.startswith(first + "."),
              "k8s StatefulSet: --rendezvous is pod 0 of the headless Service (%s)" % first, rdv)
        check(port_of(rdv) == ports.get("rendezvous"),
              "k8s StatefulSet: the rendezvous port is the containerPort named rendezvous",
              "%s vs %s" % (rdv, ports))

    # Headless Service.
    svcs = [d for d in of_kind("Service") if d["metadata"]["name"] == spec.get("serviceName")]
    if check(len(svcs) == 1, "k8s: a Service named as the StatefulSet's serviceName (%s)"
             % spec.get("serviceName")):
        ss = svcs[0].get("spec", {})
        check(ss.get("clusterIP") == "None", "k8s Service: headless (clusterIP: None)")
        ssel = ss.get("selector") or {}
        check(bool(ssel) and all(labels.get(k) == v for k, v in ssel.items()),
              "k8s Service: selector matches the pods", str(ssel))
        sports = {p.get("targetPort", p.get("port")) for p in ss.get("ports") or []}
        check("grpc" in sports or grpc_port in sports, "k8s Service: exposes the gRPC port",
              str(ss.get("ports")))
        if world > 1:
            check(ss.get("publishNotReadyAddresses") is True,
                  "k8s Service: publishes pods before they are ready (rank 0 waits for the "
                  "others before it is ready)", str(ss.get("publishNotReadyAddresses")))
    return argv[1:], conf.get("__text__")


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rnnd", required=True)
    ap.add_argument("--deploy", required=True)
    ap.add_argument("--start", action="store_true")
    a = ap.parse_args()
    a.rnnd = os.path.abspath(a.rnnd)
    d = os.path.abspath(a.deploy)
    repo = os.path.dirname(os.path.abspath(d))

    flags = known_flags(a.rnnd)
    keys = config_keys(flags)
    # The checks below mean nothing if --help could not be read: make sure it was.
    check({"listen", "http", "state-dir", "config"} <= set(flags) and flags["listen"] and
          not flags["help"], "rnnd --help lists the flags (%d found)" % len(flags))
    s, _ = parse_conf("listen 1.2.3.4:5\nno-such-key 1\n# tls-cert /x\n# prose, not a key\n")
    check([k for _, k, _ in s] == ["listen", "no-such-key"] and "no-such-key" not in keys,
          "self-check: an unknown key is seen as one")

    example = open(os.path.join(d, "rnnd.conf.example")).read()
    ex_vals = check_conf("rnnd.conf.example", example, keys, want_all=True)
    check_conf("rnnd.conf", open(os.path.join(d, "rnnd.conf")).read(), keys)

    launches = []
    if check(os.path.exists(os.path.join(d, "rnnd.service")), "rnnd.service exists"):
        unit_args = check_unit(os.path.join(d, "rnnd.service"), a.rnnd, flags, ex_vals)
        launches.append(("rnnd.service ExecStart (with rnnd.conf.example as /etc/rnnd/rnnd.conf)",
                         unit_args, example))
    cf = next((os.path.join(d, n) for n in ("Containerfile", "Dockerfile")
               if os.path.exists(os.path.join(d, n))), None)
    if check(cf is not None, "Containerfile exists"):
        launches.append(("Containerfile CMD", check_containerfile(cf, repo, flags), None))
    kdir = os.path.join(d, "k8s")
    if check(yaml is not None, "PyYAML is installed (python3-yaml; deploy/install-deps.sh)") and \
            check(os.path.isdir(kdir), "k8s/ exists"):
        r = check_k8s(kdir, flags, keys)
        if r:
            launches.append(("k8s StatefulSet args with its ConfigMap", r[0], r[1]))

    if a.start:
        start_rnnd("rnnd.conf.example", a.rnnd, ["--config", os.path.join(d, "rnnd.conf.example")])
        start_rnnd("rnnd.conf", a.rnnd, ["--config", os.path.join(d, "rnnd.conf")])
        with tempfile.TemporaryDirectory(prefix="rnnd-conf-") as tmp:
            for name, args, conf_text in launches:
                args = list(args)
                for k, v in enumerate(args):
                    if v == "--config" and k + 1 < len(args):
                        path = os.path.join(tmp, "rnnd-%d.conf" % len(os.listdir(tmp)))
                        with open(path, "w") as f:
                            f.write(conf_text or "")
                        args[k + 1] = path
                start_rnnd(name, a.rnnd, args)

    return summary()


if __name__ == "__main__":
    sys.exit(main())
