"""A module whose import leaves a file behind (at `$SONAR_TEST_TRIPWIRE`): the allow-list tests
name it from the wire and check that no process imported it."""

import os

import msgspec

if os.environ.get("SONAR_TEST_TRIPWIRE"):
    with open(os.environ["SONAR_TEST_TRIPWIRE"], "w") as f:
        f.write(f"imported by {os.getpid()}\n")


class Protocol(msgspec.Struct, tag=True):
    pass
