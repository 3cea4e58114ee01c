"""The repository's root, for tests that read its files (examples, scripts, the README) or run its commands."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REPO_ROOT = str(REPO)
