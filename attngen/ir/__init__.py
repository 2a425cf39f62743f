"""The typed IR (`nodes`), its symbolic sizes (`sym`) and its verifier (`verify`).

`from attngen import ir; ir.Program` reads the node types from here: the package re-exports `nodes`.
"""

from .nodes import *  # noqa: F401,F403
