"""How the py-spy profiles of README.md were taken (run by hand, once with
the PdConnector, once with ``plain`` for no connector): a two-server
cluster, a stream of plain 32-token requests to the decode server, py-spy
(installed into /tmp/pyspy, not a project dependency) on the decode
server's engine core and worker for 15 s at 200 Hz."""

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("ORBITKV_TESTING_SHM_SPIN_S", "1")

from orbitkv.testing.cluster import Cluster, complete
from orbitkv.testing.tiny_model import make_tiny_model

plain = len(sys.argv) > 1 and sys.argv[1] == "plain"
tag = "plain" if plain else "pd"
run = Path("/tmp/prof/run")
run.mkdir(parents=True, exist_ok=True)
model = make_tiny_model(run / "tiny")
rng = random.Random(3)


def prompt() -> list[int]:
    return [rng.randrange(3, 1024) for _ in range(128)]


def children(pid: str) -> list[str]:
    return subprocess.run(["pgrep", "-P", pid], capture_output=True, text=True).stdout.split()


with Cluster(model, run / tag, connector=not plain) as c:
    for _ in range(3):
        complete(c.decode_url, prompt(), 32, stream=True)
    api = subprocess.run(
        ["pgrep", "-f", "--", f"--port {c.spec('decode').port}"], capture_output=True, text=True
    ).stdout.split()
    stop = time.monotonic() + 25

    def load() -> None:
        while time.monotonic() < stop:
            complete(c.decode_url, prompt(), 32, stream=True)

    t = threading.Thread(target=load)
    t.start()
    time.sleep(2)
    kids = children(api[0])
    procs = kids + [g for k in kids for g in children(k)]
    recs = [
        subprocess.Popen(
            ["/tmp/pyspy/bin/py-spy", "record", "-p", p, "-d", "15", "-f", "raw", "-r", "200", "--nonblocking",
             "-o", f"/tmp/prof/{tag}-{p}.txt"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        for p in procs
    ]
    for r in recs:
        r.wait()
    t.join()
