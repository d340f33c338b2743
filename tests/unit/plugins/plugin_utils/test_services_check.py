# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Which free_gpus_services entries match nothing, on a host and on the whole play (issue 55)."""

from __future__ import annotations

import subprocess

import pytest

from ansible_collections.zeromib.gpu.plugins.plugin_utils import _services_check as check

# What the fleet's hosts list (systemctl list-units --all; list-unit-files), in part.
LISTING = """vllm.service loaded active running vLLM
ssh.service loaded active running OpenBSD Secure Shell server
getty@tty1.service loaded active running Getty on tty1
vllm.service disabled enabled
vllm-v1.service disabled enabled
sglang.service disabled enabled
getty@.service enabled enabled
nvidia-persistenced.service disabled enabled
"""
UNITS = check.listed_units(LISTING)


def test_the_listing_gives_each_unit_once():
    assert UNITS == ["vllm.service", "ssh.service", "getty@tty1.service", "vllm-v1.service", "sglang.service", "getty@.service",
                     "nvidia-persistenced.service"]


@pytest.mark.parametrize(("entry", "found"), [
    ("vllm.service", True), ("vllm", True), ("vllm*.service", True), ("sglang", True), ("getty@tty2.service", True),
    ("vlm.service", False), ("vllm-server.service", False), ("tgi*.service", False), ("getty@*.service", True), ("foo@.service", False),
])
def test_an_entry_matches_as_gpu_release_reads_it(entry, found):
    assert check.matches(entry, UNITS) is found


def test_container_and_supervisor_entries_are_left_to_a_dry_run():
    entries = ["vlm.service", "container:vllm*", "supervisor:sglang"]
    assert check.unmatched(entries, UNITS) == ["vlm.service"] and check.other_entries(entries) == ["container:vllm*", "supervisor:sglang"]
    assert check.from_release(entries, ["container:vllm*"], ["services: vlm.service matches no unit on this host"]) == [
        "vlm.service", "container:vllm*"]


@pytest.mark.parametrize(("typed", "near"), [
    # the case: vllm.service exists, and vllm-v1.service is one character closer by plain edit distance
    ("vllm-server.service", "vllm.service"),
    ("vlm.service", "vllm.service"),
    ("sglnag", "sglang.service"),
    ("nvidia-persistenced-x.service", "nvidia-persistenced.service"),
    ("totally-unrelated.service", None),
])
def test_the_suggestion_is_the_unit_that_exists_with_the_smallest_edit(typed, near):
    assert check.closest(typed, UNITS) == near


def test_a_real_typo_of_a_longer_name_still_wins_over_dropping_a_word():
    assert check.closest("vllm-sever.service", ["vllm.service", "vllm-server.service"]) == "vllm-server.service"


def _record(matched, unmatched=(), close=None):
    return {"services_matched": list(matched), "services_unmatched": list(unmatched), "services_close": close or {}}


def test_an_entry_that_matches_on_some_hosts_only_is_no_typo_and_one_that_matches_nowhere_is():
    outcomes = {
        "h200": _record(["vllm*.service"], ["sglang.service", "vllm-server.service"],
                        {"sglang.service": ["sglang-router.service"], "vllm-server.service": ["vllm.service", "vllm-v1.service"]}),
        "h100": _record(["vllm*.service", "sglang.service"], ["vllm-server.service"], {"vllm-server.service": ["vllm-v1.service"]}),
        "down": {"status": "failed"},  # its gate failed before it looked: it vouches for nothing
    }
    assert check.fleet_typos("h200", outcomes) == {"vllm-server.service": "vllm.service"}
    assert check.fleet_typos("h100", outcomes) == {"vllm-server.service": "vllm.service"}
    assert check.typo_message(check.fleet_typos("h100", outcomes)) == (
        "settings mistake, nothing was done: free_gpus_services: vllm-server.service matches no unit, container or supervisord program "
        "on any host of the play; did you mean vllm.service?")
    assert check.fleet_typos("down", outcomes) == {}


def test_only_a_no_match_line_about_an_entry_is_dropped():
    assert check.no_match_warning("services: vllm*.service matches no unit on this host", ["vllm*.service"])
    assert check.no_match_warning("services: vllm.service matches no unit on this host", ["vllm"])
    assert not check.no_match_warning("services: kept 2 units that a glob matched", ["vllm*.service"])


def test_the_listing_asks_systemd_for_the_entries_only_and_the_template_of_an_instance():
    # every unit file takes ~0.4 s to list on a small Debian host, the patterns ~10 ms (measured on the fleet)
    command = check.list_command(["vllm*", "getty@tty2.service", "it's.service", "container:tgi*"])
    assert command == ("LC_ALL=C systemctl list-units --all --plain --no-legend --no-pager -- 'vllm*.service' 'getty@tty2.service' "
                       "'getty@.service' 'it'\\''s.service' && { LC_ALL=C systemctl list-unit-files --plain --no-legend --no-pager -- "
                       "'vllm*.service' 'getty@tty2.service' 'getty@.service' 'it'\\''s.service' || [ $? -eq 1 ]; }")
    # list-unit-files exits 1 when nothing matches: an answer, not a failure (the typo of a glob)
    done = subprocess.run(["sh", "-c", "{ sh -c 'exit 1' || [ $? -eq 1 ]; } && echo ok; { sh -c 'exit 4' || [ $? -eq 1 ]; } || echo failed"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["ok", "failed"]


def test_a_guests_units_are_looked_up_by_the_dry_run_not_among_the_hosts_units():
    """lxc:/lxd:/machine: entries name a system container's units (issue 56): the host's own unit
    listing cannot match them, so they never read as a typo there."""
    entries = ["vllm.service", "lxc:101:vllm.service", "lxd:web:vllm*.service", "machine:build:vllm.service", "container:tgi", "supervisor:sg"]
    assert check.unit_entries(entries) == ["vllm.service"]
    assert check.other_entries(entries) == entries[1:]
