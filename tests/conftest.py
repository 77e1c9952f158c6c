"""Test-suite settings: every matcher run in the tests also solves each structural class member directly and
fails on any difference (sgdfuse.passes.sgd_match.MEMO_CHECK_ENV)."""

import os

os.environ.setdefault("SGDFUSE_CHECK_CLASSES", "1")
