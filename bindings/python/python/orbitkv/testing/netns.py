"""A network namespace joined to this one by two veth links, for fault tests
that cut, throttle and restore the network between prefill and decode.

The prefill server runs inside the namespace (``ip netns exec``); decode and
the proxy stay outside. Two links keep the fault on the KV path alone:

* **data** (``198.19.K.1`` outside, ``198.19.K.2`` inside): Mooncake's port
  and the prefill's side channel. :meth:`cut`, :meth:`throttle` and
  :meth:`restore` act on this link only.
* **control** (``198.19.K.5`` outside, ``198.19.K.6`` inside): the prefill's
  OpenAI API, which the proxy and the tests call. It is never touched, so a
  test can tell a transfer fault from an API outage.

A cut is a blackhole route to the other end on both sides: packets of open
connections vanish with no reset, so every open connection stalls until a
timeout, as behind a failed switch; a new connection fails at once (the
kernel here has no netem or tc drop action, which would make new connections
hang too). A throttle is a token bucket (tbf) on both ends.

Needs root (``CAP_NET_ADMIN``) and ``ip``/``tc``; :func:`available` says
whether this machine can make one, and why not.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["NetnsLink", "available"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> tuple[bool, str]:
    """(whether a namespace with veth links can be made here, why not)."""
    if os.geteuid() != 0:
        return False, "not root (network namespaces need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed (iproute2)"
    name = f"okvprobe{os.getpid() % 100000}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return True, ""


class NetnsLink:
    """A namespace with a data link and a control link to this namespace.

    ``with NetnsLink() as ns: ...`` makes it; leaving the block deletes the
    namespace (its veth ends go with it)."""

    def __init__(self) -> None:
        k = random.randrange(1, 250)
        tag = f"{os.getpid() % 10000}{k}"
        self.name = f"okv-{tag}"
        self.k = k
        self._data = (f"okvd{tag}", f"okvD{tag}")  # (outside, inside)
        self._ctl = (f"okvc{tag}", f"okvC{tag}")
        self.data_outside = f"198.19.{k}.1"
        self.data_inside = f"198.19.{k}.2"
        self.ctl_outside = f"198.19.{k}.5"
        self.ctl_inside = f"198.19.{k}.6"
        self._made = False

    # ---- life --------------------------------------------------------------

    def create(self) -> NetnsLink:
        _ip("netns", "add", self.name)
        self._made = True
        try:
            self._exec("ip", "link", "set", "lo", "up")
            for (out, inside), (a, b) in (
                (self._data, (self.data_outside, self.data_inside)),
                (self._ctl, (self.ctl_outside, self.ctl_inside)),
            ):
                _ip("link", "add", out, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", self.name)
                _ip("addr", "add", f"{a}/30", "dev", out)
                _ip("link", "set", out, "up")
                self._exec("ip", "addr", "add", f"{b}/30", "dev", inside)
                self._exec("ip", "link", "set", inside, "up")
        except BaseException:
            self.delete()
            raise
        return self

    def delete(self) -> None:
        if not self._made:
            return
        _ip("netns", "del", self.name, check=False)
        for out in (self._data[0], self._ctl[0]):
            _ip("link", "del", out, check=False)
        self._made = False

    def __enter__(self) -> NetnsLink:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.delete()

    # ---- running things inside -----------------------------------------------

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it:
        the process keeps the pid and process group it is given)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def _exec(self, *argv: str) -> None:
        subprocess.run(self.wrap(argv), capture_output=True, text=True, check=True)

    # ---- faults on the data link ------------------------------------------------

    def _both(self, *argv: str, check: bool = True) -> None:
        """Runs the command ``argv`` on each end of the data link: outside,
        then inside the namespace, with ``{dev}`` the end's device and
        ``{peer}`` the other end's address."""
        out, inside = self._data
        for wrap, dev, peer in ((list, out, self.data_inside), (self.wrap, inside, self.data_outside)):
            cmd = wrap([a.format(dev=dev, peer=peer) for a in argv])
            subprocess.run(cmd, capture_output=True, text=True, check=check)

    def cut(self) -> None:
        """The data link stops carrying packets, both ways: a blackhole
        route to the other end on each side. Packets of open connections
        vanish (TCP retransmits into nothing until its own timeouts); a new
        connection fails at once with EINVAL (``connect``). This kernel's
        ``tc`` has neither netem nor drop actions, so a pure black hole for
        new connections too is not available."""
        self._both("ip", "route", "replace", "blackhole", "{peer}/32")

    def throttle(self, rate: str) -> None:
        """The data link runs at ``rate`` (tc units: ``8mbit``) each way (tbf)."""
        self._both("tc", "qdisc", "replace", "dev", "{dev}", "root", "tbf", "rate", rate, "burst", "32kb",
                   "latency", "400ms")

    def restore(self) -> None:
        """The data link is whole again."""
        self._both("ip", "route", "del", "blackhole", "{peer}/32", check=False)
        self._both("tc", "qdisc", "del", "dev", "{dev}", "root", check=False)
