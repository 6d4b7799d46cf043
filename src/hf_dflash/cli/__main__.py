"""`python -m hf_dflash.cli ...` (as `accelerate launch -m hf_dflash.cli train ...` runs it)."""

from . import main

raise SystemExit(main())
