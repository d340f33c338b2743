# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""Which `free_gpus_services` entries match nothing, on a host and on the whole play (issue 55:
typos stop the play before anything is done).

An entry that matches nothing on one host is normal in a mixed fleet (sglang on some nodes, vLLM
on others); one that matches nothing on any host of the play is a typo, and the play fails
before any host acts. The gate lists a host's systemd units with one command before gpu_release
runs (~one SSH round trip); a host on which some entry matches nothing waits for the role's
verdict, which sees every host's record. Pure functions here; the gate and the verdict run them.
"""

from __future__ import annotations

import fnmatch
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _services
from ansible_collections.zeromib.gpu.plugins.module_utils._act._unit_kinds import is_glob, is_template, normalize_unit, parse_list_units

# Entries that name containers or supervisord programs: checked by a dry run of gpu_release, not by
# the unit listing.
# Entries that name no host unit: containers, supervisord programs and a guest's units, which the
# gate's dry run of gpu_release looks up (the prefixes are _act/_services', the one parser's).
OTHER_KINDS = (_services.CONTAINER, _services.SUPERVISOR, *_services.GUEST_PREFIXES, *_services.ORCHESTRATOR_PREFIXES)

# The units systemd has loaded (running, failed, wanted) and the unit files, aliases included, that
# the entries name: what gpu_release's own look (`systemctl show` LoadState) finds. Asked with the
# entries as patterns: listing every unit file takes ~0.4 s on a small Debian host, the patterns
# ~10 ms. C locale: the columns are parsed.
# list-unit-files exits 1 when no unit file matches the patterns (systemd 252): that is an answer
# (nothing matches), not a failure to ask; any other status is.
_LIST = ("LC_ALL=C systemctl list-units --all --plain --no-legend --no-pager -- {patterns} && "
         "{{ LC_ALL=C systemctl list-unit-files --plain --no-legend --no-pager -- {patterns} || [ $? -eq 1 ]; }}")
# Every service unit of the host, for "did you mean": asked only when an entry matched nothing.
LIST_SERVICES = ("LC_ALL=C systemctl list-units --all --type=service --plain --no-legend --no-pager && "
                 "LC_ALL=C systemctl list-unit-files --type=service --plain --no-legend --no-pager")


def _quoted(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def list_command(entries: t.Iterable[str]) -> str:
    """The command that lists what ENTRIES (unit names and globs) may match, and the template of
    each instance named (`getty@tty2.service` exists when `getty@.service` does)."""
    patterns: list[str] = []
    for entry in unit_entries(entries):
        pattern = normalize_unit(str(entry))
        prefix, at, rest = pattern.partition("@")
        for name in (pattern, f"{prefix}@.{rest.rsplit('.', 1)[-1]}" if at and not is_glob(pattern) else None):
            if name and name not in patterns:
                patterns.append(name)
    return _LIST.format(patterns=" ".join(_quoted(p) for p in patterns))


def unit_entries(entries: t.Iterable[str]) -> list[str]:
    return [entry for entry in entries if not str(entry).startswith(OTHER_KINDS)]


def other_entries(entries: t.Iterable[str]) -> list[str]:
    return [entry for entry in entries if str(entry).startswith(OTHER_KINDS)]


def listed_units(stdout: str) -> list[str]:
    """The units of LIST_UNITS' output, each once, in order."""
    seen: dict[str, None] = {}
    for unit in parse_list_units(stdout):
        seen.setdefault(unit, None)
    return list(seen)


def matches(entry: str, units: t.Collection[str]) -> bool:
    """Whether a services entry (a unit name or glob, as gpu_release reads it) names a unit of UNITS."""
    pattern = normalize_unit(entry)
    if is_glob(pattern):
        return any(fnmatch.fnmatchcase(unit, pattern) for unit in units if not is_template(unit))
    if pattern in units:
        return True
    # `getty@tty1.service` exists when its template does.
    prefix, at, rest = pattern.partition("@")
    return bool(at) and f"{prefix}@.{rest.rsplit('.', 1)[-1]}" in units


def unmatched(entries: t.Iterable[str], units: t.Collection[str]) -> list[str]:
    return [entry for entry in unit_entries(entries) if not matches(entry, units)]


def from_release(entries: t.Iterable[str], not_found: t.Iterable[str], warnings: t.Iterable[t.Any]) -> list[str]:
    """The entries gpu_release found nothing for (check mode, a dry run): `services_not_found`, and
    the globs it warned about ("services: X matches no unit on this host")."""
    missing = {str(name) for name in not_found}
    texts = [w for w in warnings if isinstance(w, str)]
    found = []
    for entry in entries:
        names = {str(entry), normalize_unit(str(entry))}
        if names & missing or any(f"services: {name} matches no unit" in text for name in names for text in texts):
            found.append(entry)
    return found


def no_match_warning(text: t.Any, entries: t.Iterable[str]) -> bool:
    """Whether a gpu_release warning only says that one of ENTRIES matches no unit on this host
    (the fleet check says it once instead, when it matters)."""
    return isinstance(text, str) and any(f"services: {name} matches no unit on this host" in text
                                         for entry in entries for name in (str(entry), normalize_unit(str(entry))))


def _stem(name: str) -> str:
    return name[:-len(".service")] if name.endswith(".service") else name


def _distance(a: str, b: str) -> int:
    """Levenshtein's edit distance."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def _words(name: str) -> list[str]:
    return [word for word in name.replace("_", "-").replace(".", "-").replace("@", "-").split("-") if word]


def edit_cost(typed: str, unit: str) -> int:
    """How far a unit is from what was typed: the edit distance of their names, or, where the unit's
    name is the typed one less some words (`vllm` in `vllm-server`), one per word dropped."""
    a, b = _stem(normalize_unit(typed)), _stem(unit)
    cost = _distance(a, b)
    typed_words, unit_words = _words(a), _words(b)
    if unit_words and all(word in typed_words for word in unit_words):
        cost = min(cost, len(typed_words) - len(unit_words))
    return cost


def closest(typed: str, units: t.Iterable[str]) -> str | None:
    """The unit that exists with the smallest edit from TYPED (`vllm-server.service` -> `vllm.service`
    rather than `vllm-v1.service`), or None when none is close (more than a third of the name)."""
    stem = _stem(normalize_unit(typed))
    limit = max(2, len(stem) // 3)
    ranked = sorted((edit_cost(typed, unit), _distance(stem, _stem(unit)), unit) for unit in set(units) if not is_template(unit))
    return ranked[0][2] if ranked and ranked[0][0] <= limit else None


def candidates(entries: t.Iterable[str], units: t.Collection[str], keep: int = 3) -> dict[str, list[str]]:
    """For each entry, the few closest units of this host (what the fleet check suggests from)."""
    out = {}
    for entry in entries:
        ranked = sorted((edit_cost(entry, unit), unit) for unit in units if not is_template(unit))
        out[str(entry)] = [unit for _cost, unit in ranked[:keep]]
    return out


def fleet_typos(host: str, outcomes: t.Mapping[str, t.Any]) -> dict[str, str | None]:
    """The entries unmatched on HOST that no host of the play matched either -> the closest unit
    any host has (or None). A host whose record has no `services_matched` (its gate failed before
    it looked) vouches for nothing."""
    own = outcomes.get(host) or {}
    matched_somewhere = {str(entry) for name, outcome in outcomes.items() if isinstance(outcome, t.Mapping)
                         for entry in outcome.get("services_matched") or []}
    typos: dict[str, str | None] = {}
    for entry in own.get("services_unmatched") or []:
        if entry in matched_somewhere:
            continue
        pool = {unit for outcome in outcomes.values() if isinstance(outcome, t.Mapping)
                for unit in (outcome.get("services_close") or {}).get(entry) or []}
        typos[entry] = closest(entry, pool)
    return typos


def typo_message(typos: t.Mapping[str, str | None]) -> str:
    """settings mistake, nothing was done: free_gpus_services: X matches ... on any host of the play; did you mean Y?"""
    said = []
    for entry, near in typos.items():
        said.append("free_gpus_services: {} matches no unit, container or supervisord program on any host of the play{}".format(
            entry, f"; did you mean {near}?" if near else ""))
    return "settings mistake, nothing was done: " + "; ".join(said)
