"""checks.py: the tally the deploy checks share: check() prints one line per check and counts it,
summary() prints "N passed, N failed" and gives the exit status (1 on any failure)."""

PASSED, FAILED = [], []


def check(ok, what, detail=""):
    """Records what as passed or failed; on a failure, detail (when given) goes on the next line."""
    (PASSED if ok else FAILED).append(what)
    print("%s  %s%s" % ("ok  " if ok else "FAIL", what, ("\n      " + str(detail)) if detail and
                                                          not ok else ""))
    return ok


def summary():
    print("%d passed, %d failed" % (len(PASSED), len(FAILED)))
    return 1 if FAILED else 0
