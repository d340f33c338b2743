"""A GPU job whose cgroup is frozen by the cgroup v1 freezer: by root (a scheduler's suspend, `docker
pause` on a v1 node) or by a user in a freezer cgroup delegated to her, who froze it herself (issue 70).

Under the v1 freezer every signal stays pending, SIGKILL included: the holder reads state D and
stays until the cgroup is thawed, then the pending SIGKILL ends it. The attacker of this shape is the
user: her own freezer cgroup (a directory root made and handed to her, as a delegation does) holds
her GPU job, and she writes FROZEN to it with her own rights. A run must never thaw her cgroup through
the cgroup file system.

    with frozen_holder(host, "jobfrz", uid=4242, delegated=True) as held:
        ...                       # gpu_release: the holder outlives SIGKILL
        assert held.state() == "FROZEN"

Everything happens inside the namespace host given (tests/sim/nshost.py; its own cgroup namespace,
the machine's hybrid hierarchy mounted at /sys/fs/cgroup/freezer), never on this machine's process
table. Teardown (always): THAWED, SIGKILL of the holder by PID, the directory removed."""
from __future__ import annotations

import contextlib
import os
import typing as t

FREEZER = "/sys/fs/cgroup/freezer"
# The name=systemd hierarchy of this hybrid machine: the cgroup path gpu_facts reads for a holder.
SYSTEMD = "/sys/fs/cgroup/systemd"


class Held(t.NamedTuple):
    host: t.Any
    pid: int
    directory: str

    def state(self) -> str:
        return self.host.read(self.directory + "/freezer.state").strip()


@contextlib.contextmanager
def frozen_holder(host: t.Any, name: str, mib: int = 1024, gpu: int = 0, uid: int | None = None, delegated: bool = False,
                  named: str | None = None) -> t.Iterator[Held]:
    """A gpu_holder on `gpu` (as `uid`, else root) in the freezer cgroup FREEZER/`name`-PID, frozen:
    by root, or (`delegated`) by the user herself in a directory handed to her. `named`: a path
    below `name` the user gives her job in both the freezer and the name=systemd hierarchy (she may
    name her delegated cgroups at will: `docker/<a real container's id>`)."""
    # The v1 hierarchies are the machine's, shared by every namespace host: a name of this pytest
    # process's own keeps two tests on two xdist workers from thawing or removing each other's cgroup
    # (seen in CI: one case's teardown thawed the other's holder before its dry run).
    name = f"{name}-{os.getpid():d}"
    roots = [FREEZER] + ([SYSTEMD] if named else [])
    tops = [f"{root}/{name}" for root in roots]
    directory = f"{tops[0]}/{named}" if named else tops[0]
    host.run(["mkdir", "-p", directory] + ([f"{SYSTEMD}/{name}/{named}"] if named else []), check=True)
    argv = ["gpu_holder", "--gpus", str(gpu), "--mib", str(mib)]
    holder = None
    try:
        if delegated:
            # The delegation: root hands her the directory and its files, as systemd does with Delegate=yes.
            host.run(["chown", "-R", f"{uid:d}:{uid:d}"] + tops, check=True)
        holder = host.spawn_as(uid, argv) if uid is not None else host.spawn(argv)
        host.run(["sh", "-c", f"echo {holder.pid:d} > {directory}/cgroup.procs"], check=True)
        if named:
            host.run(["sh", "-c", f"echo {holder.pid:d} > {SYSTEMD}/{name}/{named}/cgroup.procs"], check=True)
        freeze = ["sh", "-c", f"echo FROZEN > {directory}/freezer.state"]
        if delegated:
            freeze = ["setpriv", f"--reuid={uid:d}", f"--regid={uid:d}", "--clear-groups"] + freeze
        host.run(freeze, check=True)
        held = Held(host, holder.pid, directory)
        for _attempt in range(50):
            if held.state() == "FROZEN":
                break
            host.run(["sleep", "0.1"])
        yield held
    finally:
        host.run(["sh", "-c", f"echo THAWED > {directory}/freezer.state"])
        if holder is not None:
            holder.kill()
            holder.wait_gone()
        parts = [part for part in f"{name}/{named or ''}".split("/") if part]
        for root in roots:  # deepest first: rmdir only ever removes an empty cgroup
            for depth in range(len(parts), 0, -1):
                host.run(["rmdir", "/".join([root] + parts[:depth])])
