# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The one reader of `services`: each entry by whoever stops what it names.

`container:<glob>` names Docker/Podman containers (_containers), `supervisor:<glob>` supervisord
programs (_supervisor), anything else a systemd unit pattern (_units). gpu_release parses the
option once (`Release.named`) and hands each room its part.
"""

from __future__ import annotations

import typing as t

CONTAINER = "container:"
SUPERVISOR = "supervisor:"


class Services(t.NamedTuple):
    units: list[t.Any]  # systemd unit patterns, as the user wrote them (_units reads and checks them)
    containers: list[str]  # container name globs, once each
    programs: list[str]  # supervisord program globs, once each


def parse(services: t.Iterable[t.Any] | None) -> Services:
    """`services` -> Services. A prefix with nothing after it names nothing (and is dropped)."""
    named = Services([], [], [])
    for item in services or []:
        text = str(item).strip()
        for prefix, globs in ((CONTAINER, named.containers), (SUPERVISOR, named.programs)):
            if text.startswith(prefix):
                glob = text[len(prefix):].strip()
                if glob and glob not in globs:
                    globs.append(glob)
                break
        else:
            named.units.append(item)
    return named
