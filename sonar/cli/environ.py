"""The ``SONAR_*`` environment variables Sonar reads, and the check of the ones set.

A ``SONAR_`` variable that no part of Sonar reads is most likely a misspelling of one that does
(``SONAR_LOG_LEVELS``): `serve` warns about it at startup, or with --fail-on-environ-validation
refuses to start. `KNOWN` must list every variable the package reads (tests/cli/test_environ.py
scans the sources for them).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

PREFIX = "SONAR_"

KNOWN = frozenset(
    {
        "SONAR_ACTOR_ALLOW",
        "SONAR_ACTOR_AUTHORIZED",
        "SONAR_ACTOR_CLIENT_SECRET",
        "SONAR_ACTOR_HWM",
        "SONAR_ACTOR_KEYS",
        "SONAR_ACTOR_MAX_FRAME_BYTES",
        "SONAR_ACTOR_SERVER_SECRET",
        "SONAR_ALLOW_RUNTIME_LORA_UPDATING",
        "SONAR_CACHE_ROOT",
        "SONAR_CPU_ISA",
        "SONAR_DEVICE",
        "SONAR_FORCE_AOT_LOAD",
        "SONAR_LOG_CONFIG_FILE",
        "SONAR_LOG_LEVEL",
        "SONAR_NATIVE_KERNELS",
        "SONAR_OWN_GPU",
        "SONAR_PP_LAYER_PARTITION",
        "SONAR_RENDEZVOUS_HOST",
        "SONAR_USE_TRITON",
    }
)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One problem per ``SONAR_`` variable in `environ` that Sonar does not read, sorted, each
    naming the variable (and the known one it is closest to, if any)."""
    problems = []
    for name in sorted(n for n in environ if n.startswith(PREFIX) and n not in KNOWN):
        close = difflib.get_close_matches(name, sorted(KNOWN), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"unknown environment variable {name}{hint}")
    return problems
