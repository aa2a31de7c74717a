"""Print uv's options for the package sources pip is configured with, one per line.

uv installs Sonar's dependencies in seconds where pip takes minutes, but it reads no pip.conf: a
machine whose pip knows a local wheel store, extra indexes or constraints (this kind of machine
keeps torch's CPU build and a PyPI mirror on disk) must give them to uv, or uv would fetch other
builds from PyPI. Reads ``pip config list`` (files and PIP_* variables, the variables winning), and
asks uv to weigh every index alike, as pip does.
"""

from __future__ import annotations

import subprocess
import sys

# pip's option -> (uv's option, takes several space-separated values)
OPTIONS = {
    "index-url": ("--index-url", False),
    "extra-index-url": ("--extra-index-url", True),
    "find-links": ("--find-links", True),
    "constraint": ("--constraint", True),
}
# pip's sections, later ones overriding earlier ones as in pip (":env:" holds the PIP_* variables).
SECTIONS = ("global", "install", ":env:")


def pip_settings() -> dict[str, str]:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    found: dict[tuple[str, str], str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        found[(section, name)] = value.strip().strip("'\"")
    settings: dict[str, str] = {}
    for section in SECTIONS:
        for (where, name), value in found.items():
            if where == section:
                settings[name] = value
    return settings


def main() -> None:
    settings = pip_settings()
    args = ["--index-strategy", "unsafe-best-match"]
    for name, (flag, several) in OPTIONS.items():
        if name in settings:
            for value in settings[name].split() if several else [settings[name]]:
                args += [flag, value]
    print("\n".join(args))


if __name__ == "__main__":
    main()
