# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations


class ModuleDocFragment:

    # The attributes every action plugin of the collection shares: it runs on the controller, in
    # check mode, one host at a time, never async. A plugin's own doc stub adds the details of its
    # check mode, or a diff, over these.
    DOCUMENTATION = r"""
attributes:
  action:
    support: full
  async:
    support: none
  bypass_host_loop:
    support: none
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
    platforms: posix
"""
