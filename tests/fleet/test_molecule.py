"""The free_gpus role's Molecule scenarios (roles/free_gpus/molecule/*), run from pytest through
pytest-ansible's Molecule support (the `molecule` fixture in conftest.py), against hosts of the
fleet: prepare (busy inference units), converge, idempotence, verify."""
from __future__ import annotations


def test_molecule_scenario_converges_idempotent_and_verified(molecule):
    run = molecule.test()
    assert run.returncode == 0, f"molecule test -s {molecule.name} in {molecule.parent_directory}: rc {run.returncode}"
