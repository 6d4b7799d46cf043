"""The `hf-dflash` command line."""

from .commands import committed_drafter, main

__all__ = ["committed_drafter", "main"]
