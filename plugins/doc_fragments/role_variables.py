# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations


class ModuleDocFragment:

    # How a role's first task checks the role's variables: the free_gpus role's gate
    # (free_gpus_gate) and the other roles' role_variables_check say it once, here.
    # It adds no option: `options: {}` because ansible-core takes no fragment without options or attributes.
    DOCUMENTATION = r"""
options: {}
notes:
  - A variable with the role's prefix that is no variable of the role (a typo would leave the role on its default) is a settings
    mistake, and nothing is done; its message names the closest known one (V(free_gpus_sevices is not a variable of the
    zeromib.gpu.free_gpus role; did you mean free_gpus_services?)). So is a value not of the variable's type; its message names the
    variable, what it takes and the value given.
seealso:
  - ref: ansible_collections.zeromib.gpu.docsite.guide_free.the-roles-variables
    description: How the roles check their variables, and what a settings mistake on one host does to the play.
"""
