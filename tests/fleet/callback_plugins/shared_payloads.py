# Test-only callback: the test session's ansible-playbook runs share one AnsiballZ cache.
#
# Ansible builds a module's payload (every module_util it imports, parsed and zipped) once per
# ansible-playbook process, in a cache under that process's own local temp directory: gpu_release's
# build costs ~0.3 s of controller CPU, and the suite starts hundreds of runs of the same modules
# from the same collection. This callback, loaded by the controller before any task, points that
# cache at one directory per collection content ($ZEROMIB_SHARED_ANSIBALLZ/<key>), so a payload is
# built by the first run that needs it and read by the others. What runs on the host is the same
# payload, byte for byte: Ansible's own cache, its own lock (flock) and atomic writes; only its
# lifetime is the session's instead of the run's.
#
# The key covers what the payload is made from: the ansible-core version, and the path, size and
# mtime of every file of the collections and of ansible's module_utils. A collection rebuilt
# (`make collection`) gets a new directory. Without ZEROMIB_SHARED_ANSIBALLZ nothing changes.
from __future__ import annotations

import hashlib
import os

from ansible import constants as C
from ansible import __version__ as ansible_version
from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: shared_payloads
type: aggregate
short_description: share Ansible's AnsiballZ cache between the runs of a test session
description: Used by the test helpers (tests/fleet/conftest.py, tests/integration/ansible_in_ns.py); not part of the collection.
requirements: [enable in callbacks_enabled, ZEROMIB_SHARED_ANSIBALLZ (a directory only its user can write)]
"""


def payload_sources(collection_roots):
    """The directories payloads are built from: each collection's plugins (through the links
    `make collection` makes to the checkout) and ansible-core's module_utils."""
    import ansible.module_utils
    dirs = [os.path.dirname(ansible.module_utils.__file__)]
    for root in collection_roots:
        base = os.path.join(root, "ansible_collections")
        for namespace in sorted(os.listdir(base)) if os.path.isdir(base) else ():
            for name in sorted(os.listdir(os.path.join(base, namespace))):
                plugins = os.path.realpath(os.path.join(base, namespace, name, "plugins"))
                if os.path.isdir(plugins):
                    dirs.append(plugins)
    return dirs


def content_key(dirs):
    """A digest of every file's path, size and mtime under DIRS, and of ansible-core's version."""
    digest = hashlib.sha256(ansible_version.encode())
    for root in dirs:
        for top, subdirs, files in os.walk(root):
            # Bytecode that other tests write beside the sources is not what payloads carry.
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            for name in sorted(files):
                path = os.path.join(top, name)
                try:
                    stat = os.stat(path)
                except OSError:
                    continue
                digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "shared_payloads"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shared = os.environ.get("ZEROMIB_SHARED_ANSIBALLZ")
        if not shared:
            return
        # The cache holds pickles the controller loads: only a directory of this user's, that
        # no one else can write to, is used (else each run builds its own, as Ansible does).
        os.makedirs(shared, mode=0o700, exist_ok=True)
        stat = os.lstat(shared)
        if stat.st_uid != os.geteuid() or stat.st_mode & 0o077 or not os.path.isdir(shared) or os.path.islink(shared):
            self._display.warning(f"shared_payloads: {shared} is not a directory of this user's only; not shared")
            return
        roots = [p for p in os.environ.get("ANSIBLE_COLLECTIONS_PATH", "").split(os.pathsep) if p]
        target = os.path.join(shared, content_key(payload_sources(roots)))
        os.makedirs(target, mode=0o700, exist_ok=True)
        # Ansible reads its payloads from here (executor/module_common.py); made at its first use.
        link = os.path.join(C.DEFAULT_LOCAL_TMP, "ansiballz_cache")
        if not os.path.lexists(link):
            os.symlink(target, link)
