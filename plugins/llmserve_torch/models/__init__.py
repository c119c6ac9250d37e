"""Model families of the torch backend: one module each, registered with models/family.py as it is imported.

Every module of this package is imported here, so a family added as a new module registers itself with nothing
else to edit; the sources, the loader and the backend look families up in the registry (family_of, arch_from_hf).
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
