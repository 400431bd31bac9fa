"""What every framework plugin repeats: the gate on its framework's version, the description ``scout plugins``
reads (``scout.plugins`` entry points), and a framework's method wrapped on one object until removed.

The standard library only: a plugin's package imports this before (and without) its framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any

__all__ = ["InstanceAttribute", "PluginInfo", "UnsupportedVersion", "VersionGate"]


class UnsupportedVersion(ImportError):
    """The installed framework is outside the range its plugin is tested with (or none is installed)."""


@dataclass(frozen=True)
class PluginInfo:
    """What scout_core learns of a plugin through the entry point (each plugin's ``plugin`` object)."""

    name: str
    framework: str
    framework_version: str
    supported: str
    """The tested range, as pip writes it (``>=0.19,<0.20``)."""
    how: str
    """How to turn SCOUT on in that framework's launch."""
    tryout: str = ""
    """The plugin's CPU try-out script, a module ``scout try <name>`` runs under torchrun (empty: none)."""


@dataclass(frozen=True)
class VersionGate:
    """A plugin's tested range of its framework's versions (``(">=0.19", "<0.20")``: major.minor bounds), checked
    when the plugin is imported."""

    plugin: str
    """The plugin's distribution (``scout-deepspeed``), as the messages name it."""
    framework: str
    """The framework's distribution (``deepspeed``, ``megatron-core``)."""
    supported: tuple[str, str]
    missing_hint: str = ""
    """How to install the framework where none is (empty: the message says nothing more)."""
    outside_hint: str = ""
    """What to do when the installed version is outside the range (the message's closing parenthesis); empty:
    install a version in the range, or a version of the plugin for the installed one."""

    @property
    def spec(self) -> str:
        return ",".join(self.supported)

    def check(self, installed: str | None = None) -> str:
        """The installed framework version (or ``installed``), or :class:`UnsupportedVersion` naming it and the
        tested range."""
        if installed is None:
            try:
                installed = metadata.version(self.framework)
            except metadata.PackageNotFoundError:
                hint = f" ({self.missing_hint})" if self.missing_hint else ""
                raise UnsupportedVersion(f"{self.plugin} needs {self.framework} {self.spec}, and none is installed"
                                         f"{hint}") from None
        major_minor = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
        low, high = (_major_minor(bound, prefix) for bound, prefix in zip(self.supported, (">=", "<"), strict=True))
        if not low <= major_minor < high:
            hint = self.outside_hint or f"install a {self.framework} in that range, or a {self.plugin} for yours"
            raise UnsupportedVersion(f"{self.plugin} supports {self.framework} {self.spec}; {self.framework} "
                                     f"{installed} is installed ({hint})")
        return installed

    def describe(self, framework_version: str, *, name: str, how: str, tryout: str = "") -> PluginInfo:
        """The plugin's entry-point object, once :meth:`check` gave the framework's version."""
        return PluginInfo(name=name, framework=self.framework, framework_version=framework_version,
                          supported=self.spec, how=how, tryout=tryout)


def _major_minor(bound: str, prefix: str) -> tuple[int, ...]:
    """``(0, 19)`` of ``">=0.19"``: a bound of the tested range, which must start with ``prefix``."""
    if not bound.startswith(prefix):
        raise ValueError(f"a tested range is ('>=X.Y', '<X.Y'); got the bound {bound!r}")
    return tuple(int(p) for p in bound[len(prefix):].split("."))


class InstanceAttribute:
    """Sets ``obj.name`` on the instance until :meth:`remove`, which puts back what the instance had there (an
    attribute of its own, such as an LR scheduler's wrapper of ``optimizer.step``) or nothing (the class's
    again). A hook handle's interface."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name, self.value = obj, name, value
        self.had = name in vars(obj)
        self.before = vars(obj).get(name)
        setattr(obj, name, value)

    def remove(self) -> None:
        if vars(self.obj).get(self.name) is not self.value:
            return  # replaced since (someone wrapped ours): theirs stays, and with it what it calls
        if self.had:
            setattr(self.obj, self.name, self.before)
        else:
            vars(self.obj).pop(self.name, None)
