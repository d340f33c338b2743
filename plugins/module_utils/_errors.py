# -*- coding: utf-8 -*-
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The one error gpu_release fails with, shared by the rooms it orchestrates (units, signals)."""

from __future__ import annotations


class ReleaseError(Exception):
    """The GPUs could not be freed, or the request cannot be carried out. `result` is what
    was done up to then (a failure keeps the record of stopped units and signalled PIDs)."""

    def __init__(self, msg, result=None):
        super().__init__(msg)
        self.msg = msg
        self.result = result or {}
