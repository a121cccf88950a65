"""argparse value types shared by every command: a bad value is a usage error (exit 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def _number(cast: Callable[[str], Any], check: Callable[[Any], bool], what: str) -> Callable:
    """An argparse type: a bad value is a usage error (exit 2) that says what is expected."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


positive_int = _number(int, lambda v: v > 0, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: v > 0, "a positive number")
non_negative_float = _number(float, lambda v: v >= 0, "a number >= 0")
port_number = _number(int, lambda v: 0 <= v <= 65535, "a port number (0-65535)")
ratio = _number(float, lambda v: 0 <= v <= 1, "a ratio in [0, 1]")


def one_of(*choices: str) -> Callable[[str], str]:
    """An argparse type for a flag passed through to another command: one of `choices`."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse

