# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The kinds of systemd unit gpu_release treats apart (_units): launchers of other people's jobs
(never stopped to free a GPU), units that keep the node reachable and its data safe (never
selected by a glob) and essential units (refused even when named), and the pure rules of a unit's
name. Tables and names only: the rules that read a node are _units'. The controller's services
check (plugin_utils/_services_check) reads names from here without loading the /proc readers."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect

# Daemons that start other people's jobs. Stopping one ends (or orphans) every job it runs,
# on every GPU, so it is never stopped to free GPUs: its GPU jobs are signalled instead.
# Matched against the main process's executable, argv[0], script (python3 /usr/bin/jupyterhub)
# and comm, so a renamed unit file is still recognised; a process's names count only when the
# identity rule backs it (a unit's main process: systemd's MainPID; elsewhere: `vouched`).
LAUNCHER_NAMES = _protect.ProcessNames(
    # job schedulers: Slurm, PBS/OpenPBS/Torque, LSF, HTCondor, Grid Engine
    "slurmd", "slurmstepd", "slurmctld", "slurmdbd", "slurmrestd",
    "pbs_mom", "pbs_server", "pbs_server.bin", "pbs_sched", "pbs_comm", "trqauthd",
    "sbatchd", "mbatchd", "lsfd",
    "condor_master", "condor_startd", "condor_starter", "condor_schedd", "condor_shadow", "condor_procd",
    "sge_execd", "sge_qmaster", "sge_shepherd",
    # cluster runtimes that run every job's tasks as their own children: Ray (a `ray start` node:
    # raylet and gcs_server under it, the ray:: workers under raylet), Dask workers, Nomad agents.
    # "tool subcommand" is the script or binary followed by its first argument (process_names).
    "ray start", "raylet", "gcs_server",
    "dask worker", "dask cuda", "dask-worker", "dask-cuda-worker", "distributed.cli.dask_worker", "distributed.cli.dask_spec",
    "dask_cuda.cli", "dask_cuda.cli.dask_cuda_worker",
    "nomad agent",
    # time-based launchers
    "cron", "crond", "CRON", "anacron", "atd", "fcron",
    # notebook hubs, servers and kernel gateways: kernels are their children
    "jupyterhub", "jupyterhub-singleuser", "configurable-http-proxy",
    "jupyter-lab", "jupyter-notebook", "jupyter-server", "jupyter-kernelgateway", "jupyter-labhub",
    "jupyter lab", "jupyter notebook", "jupyter server", "jupyter kernelgateway", "jupyter labhub",
    "jupyterlab", "notebook", "jupyter_server", "kernel_gateway", "voila",
    # CI runners
    "gitlab-runner", "Runner.Listener", "Runner.Worker", "runsvc.sh", "buildkite-agent", "jenkins-agent", "drone-runner-exec",
    # container engines and their shims
    "dockerd", "containerd", "containerd-shim", "containerd-shim-runc-v2", "kubelet", "crio", "conmon", "podman",
    # process supervisors
    "supervisord", "circusd", "runsvdir", "runsv", "s6-svscan", "s6-supervise", "pm2",
    # login and the init system
    "sshd", "login", "systemd", "init",
    scripts=True,
)
LAUNCHER_UNITS = (
    "slurm*.service", "pbs*.service", "openpbs.service", "lsfd.service", "lsf*.service", "condor.service", "htcondor.service",
    "sge*.service", "cron.service", "crond.service", "cronie.service", "anacron.service", "atd.service", "fcron.service",
    "jupyterhub*.service", "gitlab-runner*.service", "actions.runner.*.service", "buildkite-agent*.service", "jenkins*.service",
    "docker.service", "containerd.service", "kubelet.service", "crio.service", "cri-o.service", "podman*.service",
    "k3s*.service", "rke2*.service", "supervisor.service", "supervisord.service",
    "ray.service", "raylet*.service", "dask-worker*.service", "dask-cuda-worker*.service", "nomad*.service",
    "jupyter*.service",
)
# What `services: ["*"]` (any glob) never selects, because the node stops being reachable or its
# data safe without it; named exactly, such a unit is stopped as asked. Matched by a glob, it is
# kept and listed in `kept_units` with the reason. (ESSENTIAL_UNITS, below, are refused even
# when named.)
NODE_KEEPING_UNITS = (
    ("network", (
        "networking.service", "ifup@*.service", "ifupdown*.service", "NetworkManager*.service", "systemd-networkd*.service",
        "wg-quick@*.service", "tailscaled.service", "zerotier-one.service", "openvpn*.service", "nftables.service",
        "iptables.service", "ip6tables.service", "netfilter-persistent.service", "firewalld.service", "ufw.service",
        "dhcpcd*.service", "isc-dhcp*.service", "openvswitch*.service", "ovs-*.service", "systemd-resolved.service",
    )),
    ("storage", (
        "iscsid.service", "iscsi*.service", "open-iscsi.service", "multipathd.service", "nfs*.service", "rpcbind.service",
        "rpc-*.service", "autofs.service", "lvm*.service", "zfs*.service", "mdmonitor.service", "mdadm*.service",
        "blk-availability.service", "ceph*.service", "glusterd.service", "lnet.service", "lustre*.service", "beegfs*.service",
        "gpfs*.service", "mmfs*.service", "smb*.service", "cachefilesd.service",
    )),
    ("identity", ("sssd*.service", "nslcd.service", "winbind.service", "nscd.service", "ypbind.service", "oddjobd.service")),
    ("remote access", ("sshd*.service", "ssh*.service", "dropbear*.service", "teleport*.service")),
    ("time", ("chrony.service", "chronyd.service", "ntp.service", "ntpd.service", "ntpsec.service", "openntpd.service",
              "systemd-timesyncd.service")),
)
# Units the node needs to stay reachable and sane. Named in `services`, they are refused;
# matched by a glob, skipped. systemd's own units, D-Bus, login, SSH, consoles, networking.
ESSENTIAL_UNITS = (
    "systemd-*", "dbus.*", "dbus-broker.*", "ssh.*", "sshd.*", "ssh@*", "sshd@*", "user@*", "user-runtime-dir@*",
    "*getty*", "polkit.*", "init.scope", "-.slice", "*.slice", "*.target", "*.mount", "*.device", "*.swap",
    "networking.service", "NetworkManager*", "wpa_supplicant*", "rsyslog.*", "auditd.service",
)

# The kinds of unit systemd knows: a name without one of them is a service.
UNIT_SUFFIXES = ("service", "socket", "timer", "target", "path", "scope", "slice", "mount", "device", "swap", "automount")


def normalize_unit(name: str) -> str:
    name = name.strip()
    if "." not in name.rsplit("/", 1)[-1] or name.rsplit(".", 1)[-1] not in UNIT_SUFFIXES:
        return name + ".service"
    return name


def is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")


def parse_list_units(text: str) -> list[str]:
    """First column of `systemctl list-units/list-unit-files --plain --no-legend`."""
    names = []
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] not in ("UNIT", "●"):
            names.append(fields[0])
        elif len(fields) > 1 and fields[0] == "●":
            names.append(fields[1])
    return names


def is_template(unit: str) -> bool:
    """`getty@.service`: a template, not a unit (its instances are `getty@tty1.service`)."""
    return "@." in unit
