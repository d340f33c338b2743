"""The tenants of a GPU node, built inside the rigs' hosts: the attackers every capability's tests use.

Root shares each node with tenants (the design's "Tenants" section): unprivileged users, a system
container's root, and other jobs. Before code reads, runs or removes anything, the tests list which
tenant controls it and build that tenant first. One kit, one file per tenant:

- `delegated_user.py`  a user whose unit has `Delegate=yes` and `User=`: she names her cgroups
- `guest_root.py`      a system container whose root is hostile: its own programs, /proc and answers
- `other_job.py`       another job's processes (Slurm cgroups) on the same node, some of them blocked
- `stalled_fuse.py`    a user whose FUSE mount stops answering (reads of her processes block)
- `shm_flood.py`       a user who floods /dev/shm (hundreds of thousands of empty files)
- `frozen_cgroup.py`   a GPU job frozen by the cgroup v1 freezer, by root or by a user in her delegated freezer cgroup
- `shm_user.py`        a user whose live service keeps shared memory in /dev/shm that others attach to

Every tenant acts only inside a simulated host that a test created (a namespace host or a fleet
host), never on the machine's own process table, and is torn down with it.
"""
