"""Keywords of the layer-spec contract that were renamed, and the release that renamed them.

``build_module`` reads this table: a module that still accepts a keyword under its old name
receives the value under that name (and a spec that still passes the old name reaches a module
taking the new one), with a ``ContractDeprecationWarning``, for one release after the rename; after that the old name is taken out of the table and such a module fails
with the one-line error that names the keyword. Add a row whenever a spec param or a build
keyword is renamed, and log it in the package's CHANGELOG.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class RenamedKeyword:
    old: str
    new: str
    renamed_in: str  # "mtl-models 0.2.0": the distribution and version whose specs pass ``new``
    removed_in: str  # the release from which a module accepting only ``old`` fails to build


class ContractDeprecationWarning(DeprecationWarning):
    """A plugin's module accepts a layer-spec keyword under a name that has been renamed."""


# Python hides DeprecationWarning raised outside ``__main__``; this one is addressed to plugin
# authors, whose code build_module calls from inside mtl, so it is shown (once per place).
warnings.filterwarnings("default", category=ContractDeprecationWarning)

# new name -> its rename record
RENAMED_KEYWORDS: dict[str, RenamedKeyword] = {}
