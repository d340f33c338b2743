# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Make `ansible_collections.zeromib.gpu` importable for a plain `pytest tests/unit`.

`ansible-test units` runs these tests from a real ansible_collections/zeromib/gpu tree, and
pytest-ansible (when pytest starts in the repository root) installs Ansible's collection
finder: both already serve the import. Elsewhere, `make collection` links the repository into
.build/collections, which goes on sys.path here. Nothing is imported from the collection at
conftest time: a package imported before Ansible's finder is installed would lack the
collection metadata that the finder needs later.
"""

from __future__ import annotations

import os
import sys

import pytest

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
_BUILT = os.path.join(_REPO, ".build", "collections")
if os.path.isdir(os.path.join(_BUILT, "ansible_collections", "zeromib", "gpu")) and _BUILT not in sys.path:
    sys.path.append(_BUILT)


def pytest_sessionstart(session):
    try:
        import ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi  # noqa: F401
    except ImportError as exc:
        raise pytest.UsageError(
            f"ansible_collections.zeromib.gpu is not importable ({exc}): run `make -C {_REPO} collection`, "
            "or run these tests through ansible-test units"
        ) from exc


try:
    from hypothesis import settings as _settings
except ImportError:  # pragma: no cover - hypothesis is in tests/unit/requirements.txt
    pass
else:
    # Two shared cores: keep property tests modest, and keep their example database out of
    # the tree that ansible-test copies.
    _settings.register_profile("zeromib", max_examples=200, deadline=None, database=None)
    _settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "zeromib"))
