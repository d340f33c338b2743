"""The tenant `shm_flood`: a user who floods /dev/shm with hundreds of thousands of empty files (on
the field: 300,000 in 0.7 s, no space used; one record each made gpu_facts' result 28 MB, issue
66). Test support, not collected.

- `flood(host, count)`: `count` empty files of the user in the host's own /dev/shm (a tmpfs of
  the namespace host's, never the machine's), made by one process of the user; removed by
  `unflood(host, prefix)` or on leaving `Flood` as a context manager (also on failure).
"""

USER = 4242
PREFIX = "flood-"

MAKE = ("import os, sys\nprefix, count = sys.argv[1], int(sys.argv[2])\n"
        "for n in range(count):\n    os.close(os.open('/dev/shm/%s%d' % (prefix, n), os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))\n")
REMOVE = ("import os, sys\nprefix = sys.argv[1]\n"
          "for name in os.listdir('/dev/shm'):\n    if name.startswith(prefix):\n        os.unlink('/dev/shm/' + name)\n")


def flood(host, count, prefix=PREFIX, uid=USER, timeout=120):
    """`count` empty files /dev/shm/PREFIX<n> owned by `uid`, made inside the host."""
    proc = host.run(["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--", "/usr/bin/python3", "-c", MAKE, prefix,
                     str(count)], timeout=timeout)
    assert proc.returncode == 0, proc.stderr


def unflood(host, prefix=PREFIX, timeout=120):
    host.run(["/usr/bin/python3", "-c", REMOVE, prefix], timeout=timeout)


class Flood:
    """flood() on entering, unflood() on leaving."""

    def __init__(self, host, count, prefix=PREFIX, uid=USER):
        self.host, self.count, self.prefix, self.uid = host, count, prefix, uid

    def __enter__(self):
        flood(self.host, self.count, self.prefix, self.uid)
        return self

    def __exit__(self, *exc):
        unflood(self.host, self.prefix)
