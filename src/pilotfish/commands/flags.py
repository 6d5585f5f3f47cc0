"""What every command's flags share: one way to write a duration, old flag names kept as aliases,
and ``serve --config FILE`` turned into the flags it stands for.

Durations are written with a unit, everywhere: ``500ms``, ``1s``, ``2m``, ``1h`` (or sums of them,
``1m30s``); :func:`parse_duration`. Flags that took a bare number of seconds before units came
(``wait --timeout``, ``--status-forget-after``, ``--rollout-bake`` ...) still take one
(:func:`seconds`); a flag renamed from ``--NAME-ms`` or ``--NAME-s`` takes a unit only
(:func:`duration`), so ``--quiet 100`` is refused rather than read as 100 seconds by someone who
meant milliseconds. The old names stay, as :class:`Deprecated` aliases: the same value, stored
where the new flag stores it, and one warning naming the new form (logged once the logs are set
up, in their format: :func:`report_warnings`).

The settings file (:func:`file_arguments`) is a mapping of ``serve``'s flags without their
``--`` (``quiet: 100ms``, ``node-group: [...]``): each key becomes the flag and goes through
the same parser as the command line, so a value is checked exactly as the flag's is, and an
unknown key is refused naming it and the file. Flags given on the command line win over the file
(:class:`Repeatable`: a repeatable flag given there replaces the file's list instead of adding
to it).
"""

from __future__ import annotations

import argparse
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Deprecated",
    "Repeatable",
    "SettingsFileError",
    "duration",
    "duration_or_zero",
    "file_arguments",
    "format_duration",
    "parse_duration",
    "pending_warnings",
    "report_warnings",
    "seconds",
    "seconds_or_zero",
    "warn_once",
]

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
MAX_DURATION = 366 * 86_400.0
"""The longest duration any flag takes (a year): a bound, so that a typo cannot overflow a timer."""


def parse_duration(text: str, *, bare_seconds: bool = False) -> float:
    """Seconds of ``text``: ``500ms``, ``1s``, ``2m``, ``1h``, ``1.5s`` or sums (``1m30s``). A bare
    number is seconds only with ``bare_seconds``. Raises ``ValueError`` saying what is expected."""
    value = text.strip().lower()
    if bare_seconds:
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            if math.isfinite(number):
                return number
    position, total = 0, 0.0
    for match in _PART.finditer(value):
        if match.start() != position:
            break
        total += float(match[1]) * _UNITS[match[2]]
        position = match.end()
    if not value or position != len(value):
        unit = " (or a number of seconds)" if bare_seconds else ""
        raise ValueError(f"{text!r} is not a duration: give a number and a unit, e.g. 500ms, 1s, 2m or 1h{unit}")
    return total


def format_duration(value: float) -> str:
    """``value`` seconds as a duration flag takes it: ``100ms``, ``1s``, ``5m``."""
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if value >= size and value % size == 0:
            return f"{value / size:g}{unit}"
    return f"{value * 1000:g}ms"


def _checked(text: str, *, bare_seconds: bool, zero: bool) -> float:
    try:
        value = parse_duration(text, bare_seconds=bare_seconds)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration {'of 0 or more' if zero else 'above 0'}")
    if value > MAX_DURATION:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than a year")
    return value


def duration(text: str) -> float:
    """An argparse type: a duration above 0, with its unit (seconds)."""
    return _checked(text, bare_seconds=False, zero=False)


def duration_or_zero(text: str) -> float:
    """An argparse type: a duration of 0 or more, with its unit (seconds)."""
    return _checked(text, bare_seconds=False, zero=True)


def seconds(text: str) -> float:
    """An argparse type: a duration above 0; a bare number is seconds (the form before units)."""
    return _checked(text, bare_seconds=True, zero=False)


def seconds_or_zero(text: str) -> float:
    """An argparse type: a duration of 0 or more; a bare number is seconds."""
    return _checked(text, bare_seconds=True, zero=True)


_warned: dict[str, str] = {}
_reported: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Keep ``message`` for :func:`report_warnings`, once per process for ``key``. (Flags are
    parsed before the logs are set up: the warning waits, to be logged in the chosen format.)"""
    _warned.setdefault(key, message)


def pending_warnings() -> list[str]:
    """The warnings kept by :func:`warn_once` and not reported yet."""
    return [message for key, message in _warned.items() if key not in _reported]


def report_warnings(logger: logging.Logger) -> None:
    """Log the pending warnings (once each), as warnings of ``logger``."""
    for key, message in _warned.items():
        if key not in _reported:
            _reported.add(key)
            logger.warning("%s", message)


class Deprecated(argparse.Action):
    """An old flag name kept as an alias of ``instead``: its value (parsed by its own ``type``), made
    the new flag's by ``convert`` (e.g. milliseconds to seconds), is stored in the new flag's
    ``dest``; the first use prints a warning naming the new form."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        instead: str,
        convert: Callable[[Any], Any] = lambda value: value,
        shown: Callable[[Any], str] = str,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.instead = instead
        self.convert = convert
        self.shown = shown

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        value = self.convert(values)
        setattr(namespace, self.dest, value)
        old = option_string or self.option_strings[0]
        warn_once(old, f"{old} is deprecated and will be removed: give {self.instead} {self.shown(value)}")


class Repeatable(argparse.Action):
    """``append``, except that the first use in a parse replaces the default list (which, under
    ``serve --config``, is the settings file's): flags on the command line win over the file."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


class SettingsFileError(Exception):
    """The settings file cannot be used: unreadable, not a mapping, an unknown key, a bad value."""


def _word(key: str, value: Any, action: argparse.Action) -> str:
    """The command-line word of ``key: value`` for ``action``'s flag: ``--key=value`` (a value may
    start with ``-``)."""
    if isinstance(value, bool):
        if set(action.choices or ()) == {"on", "off"}:
            return f"--{key}={'on' if value else 'off'}"  # (YAML reads an unquoted on/off as a boolean)
        raise SettingsFileError(f"{key}: {value!r} is not a value of --{key}")
    if isinstance(value, str | int | float):
        return f"--{key}={value}"
    raise SettingsFileError(f"{key}: give a single value (a string or a number), not {type(value).__name__}")


def file_arguments(
    settings: Mapping[Any, Any], parser: argparse.ArgumentParser, *, refused: Sequence[str] = ()
) -> list[str]:
    """The flags of ``parser`` that a settings file's ``settings`` stands for, in the file's order:
    ``key: value`` is ``--key=value``, a list is the flag repeated (for repeatable flags), ``key:
    true`` a flag that takes no value (false: left out).
    ``refused``: flags a file may not set (``config`` itself). Raises :class:`SettingsFileError`
    naming the key (every unknown key at once)."""
    flags = {option[2:]: action for action in parser._actions for option in action.option_strings}
    unknown = [str(key) for key in settings if not isinstance(key, str) or key not in flags or key in refused]
    if unknown:
        raise SettingsFileError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)}: the keys are "
            "serve's flags without their '--' (e.g. xds, quiet, node-group; `pilotfish serve --help` lists them)"
        )
    words: list[str] = []
    for key, value in settings.items():
        action = flags[key]
        if value is None:
            raise SettingsFileError(f"{key}: no value (remove the key to keep its default)")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise SettingsFileError(f"{key}: true or false, not {value!r}")
            words += [f"--{key}"] if value else []
            continue
        if action.nargs == 0:
            raise SettingsFileError(f"{key}: not a setting")
        if isinstance(value, list):
            if not isinstance(action, Repeatable):
                raise SettingsFileError(f"{key}: --{key} takes one value, not a list")
            words += [_word(key, item, action) for item in value]
        else:
            words.append(_word(key, value, action))
    return words


def read_settings(path: Path, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s flags as the settings file at ``path`` gives them, checked by ``parser`` itself
    (its defaults for the keys the file leaves out). Raises :class:`SettingsFileError`."""
    from pilotfish.app.settings import read_settings_file
    from pilotfish.errors import ConfigError

    try:
        settings = read_settings_file(path)
    except ConfigError as exc:
        raise SettingsFileError("; ".join(str(problem) for problem in exc.problems)) from None
    words = file_arguments(settings, parser, refused=("config", "help", "print-settings"))
    exit_on_error = parser.exit_on_error
    parser.exit_on_error = False  # (an error names the file, not the command line)
    try:
        namespace, extra = parser.parse_known_args(words)
    except argparse.ArgumentError as exc:
        raise SettingsFileError(str(exc).replace("argument --", "")) from None
    finally:
        parser.exit_on_error = exit_on_error
    if extra:
        raise SettingsFileError(f"not settings: {' '.join(extra)}")
    return namespace
