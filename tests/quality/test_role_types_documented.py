# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The roles' variables carry their real types into the reference (issue 67): their argument specs
say `raw` so that the roles' own one-line errors come first, and the docsite is built from a copy
typed as the roles' first tasks check them (tests/tools/build_docsite.py); docs/free_gpus.md
(tests/tools/gen_docs.py) has the same types."""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "tools"))
import build_docsite  # noqa: E402

# Raw for real: false, true or seconds, which gpu_restore's own check says.
RAW = {"restore_gpus_wait_for_gpus"}


def test_the_documented_copy_types_every_variable_that_the_roles_check(tmp_path):
    root = build_docsite.typed_collection(tmp_path)
    for role in build_docsite.ROLE_TYPES:
        shipped = yaml.safe_load((REPO / "roles" / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
        documented = yaml.safe_load((root / "ansible_collections" / "zeromib" / "gpu" / "roles" / role / "meta" / "argument_specs.yml")
                                    .read_text())["argument_specs"]["main"]["options"]
        assert set(documented) == set(shipped)
        raw = {name for name, option in documented.items() if option.get("type") == "raw"}
        assert raw <= RAW, (role, sorted(raw))
        # the roles' own files keep raw: Ansible's validation lets the roles say a mistake in their words
        assert any(option.get("type") == "raw" for option in shipped.values()), role
    free = yaml.safe_load((root / "ansible_collections/zeromib/gpu/roles/free_gpus/meta/argument_specs.yml").read_text())
    options = free["argument_specs"]["main"]["options"]
    assert options["free_gpus_wait_timeout"]["type"] == "float"
    assert (options["free_gpus_services"]["type"], options["free_gpus_services"]["elements"]) == ("list", "str")
    assert options["free_gpus_service_state"]["choices"] == ["stopped", "disabled", "masked"]
    assert not (root / "ansible_collections/zeromib/gpu/tests").exists()


def test_the_generated_role_page_shows_the_real_types():
    page = (REPO / "docs" / "free_gpus.md").read_text()
    assert "| `free_gpus_wait_timeout` | float |" in page and "| `free_gpus_services` | list[str] |" in page
    assert "| raw |" not in page
