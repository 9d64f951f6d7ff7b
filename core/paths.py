"""Where things are: the checkout, the tunings shipped per GPU model, the user's build cache."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the checkout (cpp/, kernels/, the packages)
TUNINGS = REPO / "kernels" / "tunings"  # tuned choices shipped per GPU model: <gpu>/<rung>.json|tsv
# C++ builds, keyed by toolchain and source digest, kept between runs (LADDER_CACHE overrides)
USER_CACHE = Path(os.environ.get("LADDER_CACHE", Path.home() / ".cache" / "tier-ladder"))
