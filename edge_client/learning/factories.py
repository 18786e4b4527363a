"""A user's code named as ``"package.module:callable"``: a model factory (``[model] factory``) or a task factory
(``[task] factory``), found on the server and on every device.

The server imports what its operator's configuration names. A device imports only code its operator allowed
(``edge-client run --model-path DIR`` or ``--model-package NAME``): the name arrives from the network, and importing a
module runs it, so a device never imports a module the server merely named.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FACTORY_KEY", "AllowedCode", "FactoryError", "build_with_factory", "factory_modules", "load_factory"]

#: The spec key (``[model]``, ``[task]``) naming a user's ``"package.module:callable"``.
FACTORY_KEY = "factory"

_REF_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


class FactoryError(ValueError):
    """A factory reference that cannot be used; the message names the key and the fix."""


@dataclass(frozen=True)
class AllowedCode:
    """Where a device may import user code from: directories (put on ``sys.path``) and installed packages.

    ``anything`` is the server's policy: its own configuration is trusted.
    """

    paths: tuple[Path, ...] = ()
    packages: tuple[str, ...] = ()
    anything: bool = False

    @classmethod
    def of(cls, paths: Sequence[str | Path] = (), packages: Sequence[str] = ()) -> AllowedCode:
        resolved = []
        for p in paths:
            path = Path(p).expanduser().resolve()
            if not path.is_dir():
                raise FactoryError(f"--model-path {p}: not a directory (give the directory holding your model module)")
            resolved.append(path)
        return cls(tuple(resolved), tuple(packages))

    def permits(self, module: str) -> bool:
        """Whether ``module`` may be imported: under an allowed directory or in an allowed package. Only the
        top-level name is looked up, which imports nothing."""
        if self.anything:
            return True
        top = module.split(".")[0]
        if top in self.packages:
            return True
        self.activate()
        spec = importlib.util.find_spec(top)
        if spec is None:
            return False
        places = [spec.origin] if spec.origin else []
        places += list(spec.submodule_search_locations or [])
        return bool(places) and all(any(Path(p).resolve().is_relative_to(root) for root in self.paths) for p in places)

    def activate(self) -> None:
        """Put the allowed directories on ``sys.path`` (once)."""
        for path in self.paths:
            if str(path) not in sys.path:
                sys.path.insert(0, str(path))


SERVER = AllowedCode(anything=True)
#: A device without --model-path or --model-package: built-in models and tasks only.
NOTHING = AllowedCode()


def load_factory(ref: Any, key: str, allowed: AllowedCode = SERVER) -> Callable[..., Any]:
    """The callable ``ref`` names (``"package.module:callable"``); ``key`` is the config key it came from."""
    if not isinstance(ref, str) or not _REF_RE.fullmatch(ref):
        raise FactoryError(f'{key} = {ref!r}: expected "package.module:callable", e.g. "sensor_model:build"')
    module_name, attr = ref.split(":")
    if not allowed.permits(module_name):
        raise FactoryError(
            f"{key} = {ref!r}: this device does not import {module_name!r}; start edge-client run with "
            f"--model-path DIR (the directory holding {module_name.split('.')[0]}) or "
            f"--model-package {module_name.split('.')[0]} (an installed package)"
        )
    allowed.activate()
    hint = "put its directory on PYTHONPATH or install its package" if allowed.anything else "check --model-path"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(f"{key} = {ref!r}: cannot import {module_name!r} ({exc}); {hint}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise FactoryError(f"{key} = {ref!r}: {module_name} has no callable {attr!r}")
    return fn


def factory_modules(*specs: Mapping[str, Any]) -> tuple[str, ...]:
    """The top-level modules the specs' factories come from: what a simulated device, which runs the server's own
    configuration, is allowed to import (``--model-package``)."""
    refs = (spec.get(FACTORY_KEY) for spec in specs)
    return tuple(sorted({ref.split(":")[0].split(".")[0] for ref in refs if isinstance(ref, str)}))


def build_with_factory(section: str, spec: dict[str, Any], allowed: AllowedCode, kind: type, kind_name: str) -> Any:
    """Call the factory ``spec["factory"]`` of config section ``section`` with the spec's other keys; the result must
    be a ``kind``."""
    kwargs = dict(spec)
    ref = kwargs.pop(FACTORY_KEY)
    if "name" in kwargs:
        raise FactoryError(f"[{section}]: give either 'name' (a built-in one) or 'factory' (your own), not both")
    factory = load_factory(ref, f"{section}.factory", allowed)
    try:
        built = factory(**kwargs)
    except TypeError as exc:
        raise FactoryError(
            f"{section}.factory = {ref!r} does not take the [{section}] keys {sorted(kwargs)}: {exc}"
        ) from None
    if not isinstance(built, kind):
        raise FactoryError(f"{section}.factory = {ref!r} returned {type(built).__name__}, not {kind_name}")
    return built
